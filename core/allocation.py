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

#: a row may take up to this many times its equal share of the batch's nodes
MAX_ROW_SHARE = 3
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


def allocate(trees: Sequence[DraftTree], total: int, ratios: Sequence[float]) -> list[DraftTree]:
    """Keep the ``total`` drafted nodes of best expected acceptance across ``trees``.

    Nodes are ranked by ``score + log(ratio of its row)``; a parent ranks before an equally
    scored child (trees are topologically ordered and the sort is stable), so every kept node's
    ancestors are kept.
    """
    drafted = [tree.size - 1 for tree in trees]
    if sum(drafted) <= total:
        return list(trees)
    device = trees[0].device
    values = torch.cat(
        [tree.scores[1:] + math.log(max(ratio, 1e-6)) for tree, ratio in zip(trees, ratios, strict=True)]
    )
    order = torch.sort(values, descending=True, stable=True).indices
    chosen = torch.zeros(values.shape[0], dtype=torch.bool, device=device)
    chosen[order[:total]] = True
    kept: list[DraftTree] = []
    for tree, part in zip(trees, chosen.split(drafted), strict=True):
        keep = torch.cat([torch.ones(1, dtype=torch.bool, device=device), part])
        kept.append(tree if bool(keep.all()) else tree.select(keep))
    return kept


def row_budget_cap(share: int, rows: int) -> int:
    """The budget a row's tree is drafted at before the allocation: up to ``MAX_ROW_SHARE`` times
    its equal ``share`` of the batch's nodes, never past their total."""
    return share * min(MAX_ROW_SHARE, rows)
