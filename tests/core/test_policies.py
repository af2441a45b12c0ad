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
from jetflow.policies.eagle_dynamic import EagleDynamic
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


class DepthSession:
    """Proposals that depend only on a node's depth (a parallel head), with ties, absent
    proposals past a small draft vocabulary and fewer depths than the shape allows."""

    def __init__(self, seed: int, depths: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        logits = torch.randint(0, 4, (depths, vocab), generator=generator).float()  # ties on purpose
        self.logprobs = torch.log_softmax(logits, dim=1)
        self.max_depth = depths

    def depth_proposals(self, k: int) -> tuple[Tensor, Tensor]:
        values, tokens = self.logprobs.topk(min(k, self.logprobs.shape[1]), dim=1)
        pad = k - values.shape[1]
        absent = torch.full((values.shape[0], pad), float("-inf"))
        tokens = torch.cat([tokens, torch.zeros_like(absent, dtype=torch.long)], 1)
        return tokens, torch.cat([values, absent], 1)

    def children(self, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
        tokens, values = self.depth_proposals(k)
        depths = tree.depths[nodes]
        rows = depths.clamp(max=values.shape[0] - 1)
        return tokens[rows], values[rows].masked_fill((depths >= values.shape[0])[:, None], float("-inf"))


@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 5),
    budget=st.integers(1, 12),
    width=st.integers(1, 4),
    max_depth=st.integers(1, 6),
    vocab=st.integers(1, 6),
)
@settings(max_examples=60, deadline=None)
def test_batched_growth_equals_each_row_grown_alone(
    seed: int, rows: int, budget: int, width: int, max_depth: int, vocab: int
) -> None:
    """`build_rows` over depthwise sessions gives every row exactly the tree `build` gives it:
    same nodes in the same order, scores, ancestor masks and depths."""
    shape = TreeShape(budget=budget, width=width, max_depth=max_depth)
    sessions = [DepthSession(seed + row, depths=1 + (seed + row) % 5, vocab=vocab) for row in range(rows)]
    roots = [DraftTree.root(torch.tensor(row)) for row in range(rows)]
    policies = [
        BestFirst(BestFirst.Params()),
        Chain(Chain.Params()),
        EagleDynamic(EagleDynamic.Params(top_k=2)),
    ]
    for policy in policies:
        policy_class = type(policy)
        batched = policy_class.build_rows([policy] * rows, sessions, roots, shape)
        for session, root, tree in zip(sessions, roots, batched, strict=True):
            alone = policy.build(session, root, shape)
            for part in ("tokens", "parents", "scores", "ancestor_mask", "depths"):
                assert torch.equal(getattr(tree, part), getattr(alone, part)), (policy_class.name, part)


def test_batched_growth_falls_back_to_each_row_for_path_dependent_sessions() -> None:
    """A session whose children depend on the path builds row by row, as `build` does."""
    shape = TreeShape(budget=6, width=3, max_depth=4)
    sessions = [PathSession(seed) for seed in range(3)]
    roots = [DraftTree.root(torch.tensor(1)) for _ in sessions]
    policy = BestFirst(BestFirst.Params())
    batched = BestFirst.build_rows([policy] * 3, sessions, roots, shape)
    for session, root, tree in zip(sessions, roots, batched, strict=True):
        assert torch.equal(tree.tokens, policy.build(session, root, shape).tokens)
