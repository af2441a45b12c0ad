"""Level-wise tree growth shared by every built-in policy.

Cumulative draft log-probability never increases along a path, so the ``budget`` best
nodes of the full ``width``-ary proposal tree are automatically closed under ancestors:
best-first search equals "keep the top-``budget`` scores". Growing one level at a time
with a batched ``children`` call per level therefore finds the exact best-first tree,
keeping at most ``frontier`` nodes per level (``budget`` for best-first, a small top-k for
EAGLE-2's dynamic tree, 1 for a chain). Python loops only over levels, never over nodes.
Where a node's proposals depend only on its depth (a parallel head), the trees of all rows of
a batched step grow together, one tensor program per level.
The tree lives on the root's device (the target's); a session's answers are moved there.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from jetflow.core.contracts import DepthwiseSession, DraftSession, TreePolicy, TreeShape, is_depthwise
from jetflow.core.tree import DraftTree
from torch import Tensor


class LevelwisePolicy(TreePolicy):
    """A policy that grows level by level, keeping ``frontier`` nodes of each level to expand."""

    @abstractmethod
    def frontier(self, shape: TreeShape) -> int:
        """Nodes of a level expanded into the next."""

    def level_shape(self, shape: TreeShape) -> TreeShape:
        """The shape actually grown (a chain narrows it to one child per node)."""
        return shape

    def build(self, session: DraftSession, root: DraftTree, shape: TreeShape) -> DraftTree:
        grown = self.level_shape(shape)
        return grow_levelwise(session, root, grown, frontier=self.frontier(grown))

    @classmethod
    def build_rows(
        cls,
        policies: Sequence[TreePolicy],
        sessions: Sequence[DraftSession],
        roots: Sequence[DraftTree],
        shape: TreeShape,
    ) -> list[DraftTree]:
        """All rows' trees in one tensor program where every session proposes per depth; the rows'
        policies are copies of one, so the first says the frontier."""
        depthwise = [session for session in sessions if is_depthwise(session)]
        policy = policies[0]
        if len(depthwise) < len(sessions) or not isinstance(policy, LevelwisePolicy):
            return super().build_rows(policies, sessions, roots, shape)
        grown = policy.level_shape(shape)
        return grow_depthwise_rows(depthwise, roots, grown, frontier=policy.frontier(grown))


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
        best_scores, best = _best(scores, min(frontier, shape.budget, n_valid))
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


def _best(scores: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The ``count`` best of the last dimension, ties in index order (``topk`` leaves their
    order to the kernel, which could grow a row alone and in a batch differently)."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :count], indices[..., :count]


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


def grow_depthwise_rows(
    sessions: Sequence[DepthwiseSession], roots: Sequence[DraftTree], shape: TreeShape, frontier: int
) -> list[DraftTree]:
    """:func:`grow_levelwise` for every row of a batch at once, where a node's proposals depend
    only on its depth: the same trees (the ``shape.budget`` best nodes of each row, in the order
    the row's own growth gives them), with the Python loop over levels only, not over rows.

    Every row keeps the same number of frontier slots per level; absent proposals (``-inf``)
    hold a slot as placeholders and are dropped at the end. A new node's ancestor row is its
    parent's plus itself, so the masks grow with the levels.
    """
    if shape.budget <= 0 or not roots:
        return list(roots)
    device = roots[0].device
    tokens, logprobs = _stacked_proposals(sessions, shape, device)  # [R, D, k] each
    rows, depth, width = tokens.shape
    sizes = _level_sizes(depth, width, min(frontier, shape.budget))
    nodes = sum(sizes)
    row_index = torch.arange(rows, device=device)[:, None]
    scores = torch.zeros(rows, nodes, device=device)
    parents = torch.full((rows, nodes), -1, dtype=torch.long, device=device)
    node_tokens = torch.empty(rows, nodes, dtype=torch.long, device=device)
    node_tokens[:, 0] = torch.stack([root.tokens[0] for root in roots])
    depths = torch.tensor([level for level, size in enumerate(sizes) for _ in range(size)], device=device)
    masks = torch.zeros(rows, nodes, nodes, dtype=torch.bool, device=device)
    own = masks.diagonal(dim1=1, dim2=2)  # a view: node i's own bit
    own[:, 0] = True
    start = 0
    for level, size in enumerate(sizes[1:]):
        stop = start + sizes[level]  # the frontier: the previous level's nodes
        candidates = (scores[:, start:stop, None] + logprobs[:, level, None, :]).flatten(1)  # [R, f * k]
        best, index = _best(candidates, size)
        new = slice(stop, stop + size)
        scores[:, new] = best
        parents[:, new] = start + index // width
        node_tokens[:, new] = tokens[:, level].gather(1, index % width)
        masks[:, new] = masks[row_index, parents[:, new]]
        own[:, new] = True
        start = stop
    # The budget best drafted nodes of each row (a stable sort ranks a parent before an equally
    # scored child), never a placeholder.
    order = torch.sort(scores[:, 1:], dim=1, descending=True, stable=True).indices[:, : shape.budget]
    keep = torch.zeros(rows, nodes, dtype=torch.bool, device=device)
    keep[:, 0] = True
    keep[row_index, order + 1] = True
    keep &= torch.isfinite(scores)
    new_index = keep.cumsum(1) - 1
    trees = []
    for row in range(rows):
        kept = keep[row]
        old_parents = parents[row, kept]
        trees.append(
            DraftTree.derived(
                tokens=node_tokens[row, kept],
                parents=torch.where(old_parents >= 0, new_index[row, old_parents.clamp(min=0)], -1),
                scores=scores[row, kept],
                draft_probs=None,
                mask=masks[row][kept][:, kept],
                depths=depths[kept],
            )
        )
    return trees


def _level_sizes(depth: int, width: int, frontier: int) -> list[int]:
    """Nodes per level: the root, then up to ``frontier`` of the previous level's children."""
    sizes = [1]
    for _ in range(depth):
        sizes.append(min(frontier, sizes[-1] * width))
    return sizes


def _stacked_proposals(
    sessions: Sequence[DepthwiseSession], shape: TreeShape, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Every row's per-depth proposals ``[R, D, k]``, cut to the shape's depth; rows with fewer
    depths are padded with absent proposals."""
    proposals = [session.depth_proposals(shape.width) for session in sessions]
    depth = min(shape.max_depth, max(int(values.shape[0]) for _, values in proposals))

    def padded(part: Tensor, fill: float) -> Tensor:
        part = part[:depth].to(device)
        return F.pad(part, (0, 0, 0, depth - part.shape[0]), value=fill)

    tokens = torch.stack([padded(row_tokens, 0) for row_tokens, _ in proposals])
    logprobs = torch.stack([padded(row_logprobs.float(), float("-inf")) for _, row_logprobs in proposals])
    return tokens, logprobs
