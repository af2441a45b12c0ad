"""Level-wise tree growth shared by every built-in policy.

Cumulative draft log-probability never increases along a path, so the ``budget`` best
nodes of the full ``width``-ary proposal tree are automatically closed under ancestors:
best-first search equals "keep the top-``budget`` scores". Growing one level at a time
with a batched ``children`` call per level therefore finds the exact best-first tree,
keeping at most ``frontier`` nodes per level (``budget`` for best-first, a small top-k for
EAGLE-2's dynamic tree, 1 for a chain). Python loops only over levels, never over nodes.
The tree lives on the root's device (the target's); a session's answers are moved there.
"""

from __future__ import annotations

import torch
from jetflow.core.contracts import DraftSession, TreeShape
from jetflow.core.tree import DraftTree


def grow_levelwise(session: DraftSession, root: DraftTree, shape: TreeShape, frontier: int) -> DraftTree:
    """Grow ``root`` level by level and keep the ``shape.budget`` best drafted nodes."""
    tree = root
    expand = torch.zeros(1, dtype=torch.long, device=root.device)
    max_depth = shape.max_depth if session.max_depth is None else min(shape.max_depth, session.max_depth)
    for _ in range(max_depth):
        tokens, logprobs = session.children(tree, expand, shape.width)  # [f, k] each
        tokens, logprobs = tokens.to(tree.device), logprobs.to(tree.device)
        scores = (tree.scores[expand, None] + logprobs).flatten()
        n_valid = int(torch.isfinite(scores).sum())
        if n_valid == 0:
            break
        best_scores, best = scores.topk(min(frontier, shape.budget, n_valid))
        # Once the budget is full, a level whose best node loses to the budget-th best
        # node cannot contribute, and nothing deeper can either: stop early.
        if tree.draft_size >= shape.budget and best_scores[0] < tree.scores[1:].topk(shape.budget).values[-1]:
            break
        start = tree.size
        tree = tree.extend(
            parents=expand[best // shape.width],
            tokens=tokens.flatten()[best],
            logprobs=logprobs.flatten()[best],
        )
        expand = torch.arange(start, tree.size, device=tree.device)
    return keep_best(tree, shape.budget)


def keep_best(tree: DraftTree, budget: int) -> DraftTree:
    """The sub-tree of the ``budget`` highest-scoring drafted nodes.

    A stable sort breaks ties by node index, so a parent always ranks before an equally
    scored child and the kept set stays closed under ancestors.
    """
    if tree.draft_size <= budget:
        return tree
    order = torch.sort(tree.scores[1:], descending=True, stable=True).indices[:budget] + 1
    keep = torch.zeros(tree.size, dtype=torch.bool, device=tree.device)
    keep[order] = True
    return tree.select(keep)
