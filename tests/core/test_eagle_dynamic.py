"""The eagle-dynamic policy: EAGLE-2's level-wise top-k expansion under a node budget."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jetflow.core.contracts import TreeShape
from jetflow.core.errors import ConfigError
from jetflow.core.tree import DraftTree
from jetflow.policies.best_first import BestFirst
from jetflow.policies.eagle_dynamic import EagleDynamic
from torch import Tensor

from .test_policies import PathSession, _paths


class CountingSession(PathSession):
    """A path-dependent session that records every ``children`` call (one head forward each)."""

    def __init__(self, seed: int, max_depth: int | None = None) -> None:
        super().__init__(seed, max_depth)
        self.calls: list[tuple[DraftTree, Tensor]] = []

    def children(self, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
        self.calls.append((tree, nodes.clone()))
        return super().children(tree, nodes, k)


def _policy(top_k: int) -> EagleDynamic:
    return EagleDynamic(EagleDynamic.Params(top_k=top_k))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    budget=st.integers(1, 40),
    width=st.integers(1, 5),
    max_depth=st.integers(1, 7),
    top_k=st.integers(1, 6),
)
def test_one_call_per_level_on_the_top_k_of_the_last_level(seed, budget, width, max_depth, top_k) -> None:
    shape = TreeShape(budget=budget, width=width, max_depth=max_depth)
    session = CountingSession(seed)
    tree = _policy(top_k).build(session, DraftTree.root(0), shape)
    assert 1 <= tree.draft_size <= budget and tree.max_depth <= max_depth
    assert len(session.calls) <= max_depth
    assert tree.max_depth <= len(session.calls)  # a level is only reached through one more call
    assert session.calls[0][1].tolist() == [0]
    for (previous, expanded), (grown, nodes) in zip(session.calls, session.calls[1:], strict=False):
        # the nodes expanded next are exactly the level this call added: its best top_k candidates
        assert torch.equal(nodes, torch.arange(previous.size, grown.size))
        assert 1 <= nodes.numel() <= min(top_k, budget)
        _, logprobs = PathSession(seed).children(previous, expanded, width)
        candidates = (previous.scores[expanded, None] + logprobs).flatten()
        torch.testing.assert_close(grown.scores[nodes], candidates.topk(nodes.numel()).values)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    budget=st.integers(1, 30),
    width=st.integers(1, 4),
    max_depth=st.integers(1, 6),
    extra=st.integers(0, 5),
)
def test_equals_best_first_when_top_k_covers_the_budget(seed, budget, width, max_depth, extra) -> None:
    shape = TreeShape(budget=budget, width=width, max_depth=max_depth)
    dynamic = _policy(budget + extra).build(PathSession(seed), DraftTree.root(0), shape)
    best_first = BestFirst(BestFirst.Params()).build(PathSession(seed), DraftTree.root(0), shape)
    assert _paths(dynamic) == _paths(best_first)


def test_a_small_top_k_keeps_a_narrow_deep_tree() -> None:
    """Each level expands only its top_k nodes, so the budget is spread over more levels."""
    shape = TreeShape(budget=12, width=4, max_depth=6)
    session = CountingSession(7)
    tree = _policy(2).build(session, DraftTree.root(0), shape)
    assert tree.draft_size == 12
    per_level = torch.bincount(tree.depths[1:], minlength=7)[1:]
    assert int(per_level.max()) <= 4  # at most top_k parents x width children per level
    assert [nodes.numel() for _, nodes in session.calls] == [1] + [2] * (len(session.calls) - 1)


def test_top_k_is_validated() -> None:
    from jetflow.core.config import GenerateConfig, build_config

    with pytest.raises(ConfigError, match="top_k"):
        build_config(
            GenerateConfig, {"drafter": "ngram", "tree": {"policy": "eagle-dynamic", "params": {"top_k": 0}}}
        )
