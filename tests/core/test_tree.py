"""DraftTree: derived structure from parent indices."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jetflow.core.tree import DraftTree


@st.composite
def random_trees(draw, max_nodes: int = 24) -> DraftTree:
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(2, 255), min_size=n, max_size=n))
    return DraftTree(
        tokens=torch.tensor(tokens), parents=torch.tensor(parents), scores=-torch.arange(n).float()
    )


def _ancestors(parents: list[int], node: int) -> set[int]:
    found = {node}
    while parents[node] >= 0:
        node = parents[node]
        found.add(node)
    return found


@settings(max_examples=200, deadline=None)
@given(random_trees())
def test_ancestor_mask_and_depths_match_a_walk_up_the_parents(tree: DraftTree) -> None:
    parents = tree.parents.tolist()
    for node in range(tree.size):
        expected = _ancestors(parents, node)
        assert set(torch.nonzero(tree.ancestor_mask[node]).flatten().tolist()) == expected
        assert tree.depths[node] == len(expected) - 1
        assert tree.path(node).tolist() == sorted(expected)


@settings(max_examples=100, deadline=None)
@given(random_trees())
def test_path_tokens_hold_each_path_by_depth(tree: DraftTree) -> None:
    for node in range(tree.size):
        path = tree.path(node)[1:]
        row = tree.path_tokens[node]
        assert row[: len(path)].tolist() == tree.tokens[path].tolist()
        assert bool((row[len(path) :] == -1).all())


def test_select_keeps_ancestors_and_remaps_parents() -> None:
    tree = DraftTree.root(5).extend(torch.tensor([0, 0]), torch.tensor([6, 7]), torch.tensor([-0.1, -1.0]))
    tree = tree.extend(torch.tensor([1, 2]), torch.tensor([8, 9]), torch.tensor([-0.2, -0.3]))
    sub = tree.select(torch.tensor([True, False, True, False, True]))
    assert sub.tokens.tolist() == [5, 7, 9]
    assert sub.parents.tolist() == [-1, 0, 1]
    assert sub.scores.tolist() == pytest.approx([0.0, -1.0, -1.3])
    with pytest.raises(ValueError, match="ancestor"):
        tree.select(torch.tensor([True, False, False, True, False]))


def test_parents_must_be_topological() -> None:
    with pytest.raises(ValueError):
        DraftTree(tokens=torch.tensor([1, 2, 3]), parents=torch.tensor([-1, 2, 0]), scores=torch.zeros(3))
