"""One node budget for a batch, spent where it accepts: best-first over every row's tree.

Each row's tree is drafted at a budget larger than its equal share; the step then keeps the
``total`` drafted nodes, across all rows, with the best expected acceptance. A node's expected
acceptance is the draft's probability of its path, ``exp(score)``, times its row's calibration:
how many tokens the row's steps accepted against how many their trees predicted (a head that
is over-confident on one prompt gets fewer nodes there). For a nested policy (best-first, chain)
the kept nodes of a row are exactly the row's own tree of that smaller budget (a parent never
ranks below its child), so the allocation only chooses each row's budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jetflow.core.tree import DraftTree

#: a row may take up to this many times its equal share of the batch's nodes ...
MAX_ROW_SHARE = 3
#: ... and reach at most this many levels below its share's deepest tree (a chain of ``share``
#: nodes): the extra nodes widen a confident row's tree. Deeper drafts rarely survived the cut
#: back to the batch's total, and every drafted level costs every row a head slot and a level of
#: tree building.
EXTRA_DEPTH = 1
#: the calibration's prior: one step predicting as much as it accepted
PRIOR_STEPS = 2.0
#: per-step forgetting of a row's calibration (an effective memory of ~20 steps)
FORGETTING = 0.95


@dataclass
class RowCalibration:
    """Accepted against predicted tokens over a row's recent steps (discounted)."""

    accepted: float = PRIOR_STEPS
    predicted: float = PRIOR_STEPS

    @property
    def ratio(self) -> float:
        return self.accepted / self.predicted

    def observe(self, tree: DraftTree, accepted: int) -> None:
        """One verified step: the tree's predicted accepted length against what it accepted."""
        if tree.size == 1:
            return
        self.accepted = FORGETTING * self.accepted + accepted
        self.predicted = FORGETTING * self.predicted + float(tree.scores[1:].exp().sum())


@dataclass(frozen=True)
class Allocation:
    """How one step spread its nodes across its rows: ``share`` per row on average, the drafted
    nodes ranked best-first across all rows by ``score + offsets[row]`` (the row's log ratio)."""

    share: int
    offsets: list[float]

    @classmethod
    def of(cls, share: int, ratios: Sequence[float]) -> Allocation:
        return cls(share, [math.log(max(ratio, 1e-6)) for ratio in ratios])

    def ranks(self, trees: Sequence[DraftTree]) -> list[torch.Tensor]:
        """Each row's drafted nodes' 1-based ranks in the batch's order (see :func:`best_first_ranks`)."""
        return best_first_ranks(
            [tree.scores[1:] + offset for tree, offset in zip(trees, self.offsets, strict=True)]
        )


def best_first_ranks(values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """1-based ranks of every value across all of ``values`` (highest first), split as given.

    A stable sort: a parent (earlier in its tree) ranks before an equally scored child, so the
    nodes ranked at most ``b`` always include their ancestors: a nested policy's tree of ``b``.
    """
    joined = torch.cat(list(values))
    order = torch.sort(joined, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(1, order.shape[0] + 1, device=order.device)
    return list(rank.split([part.shape[0] for part in values]))


def allocate(trees: Sequence[DraftTree], allocation: Allocation) -> list[DraftTree]:
    """Keep the ``share x rows`` drafted nodes of best expected acceptance across ``trees``."""
    total = allocation.share * len(trees)
    if sum(tree.size - 1 for tree in trees) <= total:
        return list(trees)
    kept: list[DraftTree] = []
    for tree, ranks in zip(trees, allocation.ranks(trees), strict=True):
        keep = torch.cat([torch.ones(1, dtype=torch.bool, device=tree.device), ranks <= total])
        kept.append(tree if bool(keep.all()) else tree.select(keep))
    return kept


def row_budget_cap(share: int, rows: int) -> int:
    """The budget a row's tree is drafted at before the allocation: up to ``MAX_ROW_SHARE`` times
    its equal ``share`` of the batch's nodes, never past their total."""
    return share * min(MAX_ROW_SHARE, rows)


def row_depth_cap(share: int) -> int:
    """The deepest level a row drafted past its ``share`` may reach (see :data:`EXTRA_DEPTH`)."""
    return share + EXTRA_DEPTH
