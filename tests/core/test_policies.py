"""Tree policies: best-first is exact, chain is a path, budgets and depths are respected."""

from __future__ import annotations

import heapq

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jetflow.core.contracts import TreeShape
from jetflow.core.tree import DraftTree
from jetflow.policies.best_first import BestFirst
from jetflow.policies.chain import Chain
from jetflow.verifiers.greedy import Greedy
from torch import Tensor

VOCAB = 50


def _distribution(path: tuple[int, ...], seed: int) -> Tensor:
    """A fixed, path-dependent next-token log-distribution (a branch-aware drafter)."""
    generator = torch.Generator().manual_seed(hash((seed, path)) % (2**31))
    return torch.log_softmax(torch.randn(VOCAB, generator=generator) * 2, dim=0)


class PathSession:
    """Answers children from `_distribution`, like an autoregressive head would."""

    def __init__(self, seed: int, max_depth: int | None = None) -> None:
        self.seed, self.max_depth = seed, max_depth

    def children(self, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
        rows = [
            _distribution(tuple(tree.tokens[tree.path(n)[1:]].tolist()), self.seed) for n in nodes.tolist()
        ]
        logprobs, tokens = torch.stack(rows).topk(k, dim=1)
        return tokens, logprobs


def _best_first_reference(seed: int, shape: TreeShape) -> set[tuple[int, ...]]:
    """Textbook best-first search with a heap: pop the best node, push its top-width children."""
    heap: list[tuple[float, int, tuple[int, ...]]] = []
    counter = 0

    def push_children(path: tuple[int, ...], score: float) -> None:
        nonlocal counter
        if len(path) >= shape.max_depth:
            return
        logprobs, tokens = _distribution(path, seed).topk(shape.width)
        for lp, token in zip(logprobs.tolist(), tokens.tolist(), strict=True):
            counter += 1
            heapq.heappush(heap, (-(score + lp), counter, (*path, token)))

    chosen: set[tuple[int, ...]] = set()
    push_children((), 0.0)
    while heap and len(chosen) < shape.budget:
        negative, _, path = heapq.heappop(heap)
        chosen.add(path)
        push_children(path, -negative)
    return chosen


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[tree.path(n)[1:]].tolist()) for n in range(1, tree.size)}


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    budget=st.integers(1, 40),
    width=st.integers(1, 5),
    max_depth=st.integers(1, 8),
)
def test_best_first_equals_heap_search(seed: int, budget: int, width: int, max_depth: int) -> None:
    shape = TreeShape(budget=budget, width=width, max_depth=max_depth)
    tree = BestFirst(BestFirst.Params()).build(PathSession(seed), DraftTree.root(0), shape)
    assert _paths(tree) == _best_first_reference(seed, shape)
    assert tree.draft_size == min(budget, sum(width**d for d in range(1, max_depth + 1)))
    assert tree.max_depth <= max_depth


def test_session_depth_limit_is_respected() -> None:
    shape = TreeShape(budget=30, width=3, max_depth=10)
    tree = BestFirst(BestFirst.Params()).build(PathSession(1, max_depth=2), DraftTree.root(0), shape)
    assert tree.max_depth == 2


def test_chain_is_the_top1_path_of_length_budget() -> None:
    shape = TreeShape(budget=6, width=4, max_depth=16)
    tree = Chain(Chain.Params()).build(PathSession(3), DraftTree.root(0), shape)
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4, 5]
    path: tuple[int, ...] = ()
    for token in tree.tokens[1:].tolist():
        assert token == int(_distribution(path, 3).argmax())
        path = (*path, token)


def test_greedy_accepts_the_deepest_matching_path() -> None:
    # root(0) -> a(1) -> c(3); root -> b(2) -> d(4); target argmax after: root 2, b 4, d 9
    tree = DraftTree(
        tokens=torch.tensor([0, 1, 2, 3, 4]),
        parents=torch.tensor([-1, 0, 0, 1, 2]),
        scores=torch.zeros(5),
    )
    argmax = torch.tensor([2, 3, 4, 7, 9])
    logits = torch.nn.functional.one_hot(argmax, 10).float()
    decision = Greedy(Greedy.Params()).accept(tree, logits, torch.Generator())
    assert decision.path.tolist() == [0, 2, 4]
    assert decision.next_token == 9
    assert decision.accepted == 2


def test_greedy_rejects_everything_when_no_child_matches() -> None:
    tree = DraftTree(tokens=torch.tensor([0, 1, 2]), parents=torch.tensor([-1, 0, 1]), scores=torch.zeros(3))
    logits = torch.nn.functional.one_hot(torch.tensor([5, 2, 3]), 10).float()
    decision = Greedy(Greedy.Params()).accept(tree, logits, torch.Generator())
    assert decision.path.tolist() == [0]
    assert decision.next_token == 5
