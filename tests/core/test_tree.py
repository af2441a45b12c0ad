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


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=5), min_size=1, max_size=6))
def test_extend_carries_the_mask_and_depths_a_fresh_tree_derives(levels: list[list[int]]) -> None:
    """Growing level by level (as policies do) gives the mask and depths of the same tree built whole."""
    tree = DraftTree.root(torch.tensor(3))
    for level in levels:
        parents = torch.tensor([choice % tree.size for choice in level])
        tree = tree.extend(parents, torch.tensor(level) + 2, -torch.rand(len(level)))
    fresh = DraftTree(tokens=tree.tokens, parents=tree.parents, scores=tree.scores)
    assert torch.equal(tree.ancestor_mask, fresh.ancestor_mask)
    assert torch.equal(tree.depths, fresh.depths)
    keep = torch.rand(tree.size) < 0.5
    keep = (fresh.ancestor_mask & ~keep[None, :]).any(dim=1).logical_not()  # closed under ancestors
    sub = tree.select(keep)
    rebuilt = DraftTree(tokens=sub.tokens, parents=sub.parents, scores=sub.scores)
    assert torch.equal(sub.ancestor_mask, rebuilt.ancestor_mask)
    assert torch.equal(sub.depths, rebuilt.depths)


def test_extend_refuses_a_parent_past_the_tree() -> None:
    with pytest.raises(IndexError):
        DraftTree.root(1).extend(torch.tensor([1]), torch.tensor([2]), torch.tensor([-0.5]))


def test_a_root_from_a_tensor_stays_on_its_device() -> None:
    tree = DraftTree.root(torch.tensor([4, 5])[-1])
    assert tree.tokens.tolist() == [5] and tree.device == torch.device("cpu")
    assert tree.ancestor_mask.tolist() == [[True]] and tree.depths.tolist() == [0]
