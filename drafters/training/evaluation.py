"""Held-out evaluation of a head: loss, per-depth top-1 agreement with the target, chain acceptance."""

from __future__ import annotations

from typing import Any

import torch
from jetflow.drafters.examples import Predictions
from jetflow.drafters.training.batches import anchored_batch
from jetflow.drafters.training.contracts import SequenceStore, TrainableHead
from jetflow.drafters.training.objective import Objective
from torch import Tensor

#: evaluation anchors are drawn with their own seed: every evaluation of a run reads the same ones
EVAL_SEED = 4321


@torch.no_grad()
def evaluate(
    head: TrainableHead,
    objective: Objective,
    store: SequenceStore,
    ids: Tensor,
    batch_sequences: int,
    anchors_per_sequence: int,
) -> dict[str, Any]:
    """The head on sequences ``ids`` of ``store`` (empty without any); leaves it in training mode.

    ``chain_accept`` is the mean number of leading depths whose top-1 equals the target's:
    the drafted tokens a greedy chain would get accepted per step.
    """
    if len(ids) == 0:
        return {}
    head.eval()
    depth = head.max_depth
    device = objective.shared.lm_head.weight.device
    agree, count = torch.zeros(depth), torch.zeros(depth)
    loss_sum, accepted, n_anchors = 0.0, 0.0, 0
    generator = torch.Generator().manual_seed(EVAL_SEED)
    for start in range(0, len(ids), batch_sequences):
        chunk = [int(i) for i in ids[start : start + batch_sequences]]
        batch = anchored_batch(store, chunk, anchors_per_sequence, generator, device)
        preds = head.training_predictions(batch, objective.shared)
        if preds.hidden.shape[0] == 0:
            continue
        loss_sum += float(objective.mean_loss(batch, preds)) * preds.hidden.shape[0]
        hits = objective.top1_hits(batch, preds).cpu()
        depths = preds.depths.cpu() - 1
        agree += torch.bincount(depths, weights=hits.float(), minlength=depth)
        count += torch.bincount(depths, minlength=depth).float()
        runs = accepted_lengths(preds, hits, depth)
        accepted += float(runs.sum())
        n_anchors += int(runs.shape[0])
    head.train()
    total = float(count.sum())
    return {
        "eval_loss": loss_sum / max(total, 1.0),
        "agreement": [round(float(a / c), 4) if c else None for a, c in zip(agree, count, strict=True)],
        "chain_accept": accepted / max(n_anchors, 1),
    }


def accepted_lengths(preds: Predictions, hits: Tensor, max_depth: int) -> Tensor:
    """Per anchor, how many leading depths agree with the target: ``[A]``, ordered by (row, anchor).

    This is exactly what greedy verification of the head's top-1 chain from that root
    accepts: while every earlier depth agreed, the drafted prefix is the true one.
    """
    rows, depths = preds.rows.cpu(), preds.depths.cpu()
    anchors = preds.positions.cpu() - depths
    keys = rows * (int(anchors.max()) + 1) + anchors
    unique, index = torch.unique(keys, return_inverse=True)
    dense = torch.zeros(unique.shape[0], max_depth, dtype=torch.bool)
    dense[index, depths - 1] = hits.cpu()
    return dense.to(torch.long).cumprod(dim=1).sum(dim=1)
