"""What a head is trained towards: the teacher distribution and the weighted loss of its predictions.

The teacher is the target's frozen LM head over its cached final hidden states, restricted to
the head's draft vocabulary where it has one (the softmax is then the target's distribution
renormalised onto it). The LM head dominates the cost on a CPU, so it runs once per distinct
position and, over many predictions, in checkpointed chunks that bound memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jetflow.drafters.blocks import DraftLMHead, FrozenTargetParts
from jetflow.drafters.examples import ExampleBatch, Predictions
from jetflow.drafters.training.losses import LossConfig, depth_weights, position_losses
from torch import Tensor
from torch.utils.checkpoint import checkpoint

#: per-prediction loss ``[M]`` from (config, student logits, teacher log-probs or None, labels)
LossFn = Callable[[LossConfig, Tensor, Tensor | None, Tensor], Tensor]


@dataclass(frozen=True)
class Objective:
    """The loss of a head's predictions against the target, and its top-1 agreement with it.

    Attributes:
        shared: the target's frozen embedding and LM head.
        lm: the LM head over the draft vocabulary (the full one without).
        loss: which loss and its settings.
        chunk_rows: predictions per LM-head chunk.
        loss_fn: the per-position loss (:func:`position_losses` unless an ablation swaps it).
    """

    shared: FrozenTargetParts
    lm: DraftLMHead
    loss: LossConfig
    chunk_rows: int
    loss_fn: LossFn = position_losses

    @classmethod
    def build(
        cls,
        shared: FrozenTargetParts,
        draft_tokens: Tensor | None,
        loss: LossConfig,
        chunk_rows: int,
        loss_fn: LossFn = position_losses,
    ) -> Objective:
        """The objective of a head drafting over ``draft_tokens`` (None: the full vocabulary)."""
        return cls(shared, DraftLMHead.build(shared.lm_head, draft_tokens), loss, chunk_rows, loss_fn)

    @property
    def vocab_size(self) -> int:
        """The target's full vocabulary."""
        return int(self.shared.lm_head.weight.shape[0])

    def mean_loss(self, batch: ExampleBatch, preds: Predictions) -> Tensor:
        """Weighted mean loss over the predictions."""
        total, weight = self.loss_terms(batch, preds)
        return total / weight.clamp(min=1e-9)

    def loss_terms(self, batch: ExampleBatch, preds: Predictions) -> tuple[Tensor, Tensor]:
        """The weighted sum of the predictions' losses and the sum of their weights."""
        cfg = self.loss
        labels = self.lm.columns(batch.tokens[preds.rows, preds.positions], self.vocab_size)
        taught = self.teacher_logprobs(batch, preds) if cfg.needs_teacher else None
        weights = depth_weights(preds.depths, cfg.depth_decay)
        if cfg.kind == "sft" and cfg.sft_labels == "tokens":
            weights = weights * (labels >= 0)  # a token outside the draft vocabulary teaches nothing
            labels = labels.clamp(min=0)

        def chunk_loss(hidden: Tensor, teacher_rows: Tensor | None, chunk_labels: Tensor) -> Tensor:
            return self.loss_fn(cfg, self.lm.logits(hidden), teacher_rows, chunk_labels)

        rows, total = preds.hidden.shape[0], preds.hidden.new_zeros((), dtype=torch.float32)
        for part in chunks(rows, self.chunk_rows):
            teacher_rows = None if taught is None else taught[0][taught[1][part]]
            args = (preds.hidden[part], teacher_rows, labels[part])
            checkpointed = rows > self.chunk_rows
            losses = checkpoint(chunk_loss, *args, use_reentrant=False) if checkpointed else chunk_loss(*args)
            total = total + (losses * weights[part]).sum()
        return total, weights.sum().to(total.dtype)

    def teacher_logprobs(self, batch: ExampleBatch, preds: Predictions) -> tuple[Tensor, Tensor]:
        """Teacher log-probs over the draft vocabulary at the loss's temperature, once per position.

        Returns ``([U, N], inverse [M])``: row ``inverse[m]`` teaches prediction ``m``.
        """
        unique, inverse = teacher_positions(batch, preds)
        with torch.no_grad(), torch.autocast(batch.final.device.type, enabled=False):
            logits = self.lm.logits(batch.final.flatten(0, 1)[unique].float())
            if self.loss.temperature != 1.0:
                logits = logits / self.loss.temperature
            return F.log_softmax(logits, dim=-1), inverse

    @torch.no_grad()
    def top1_hits(self, batch: ExampleBatch, preds: Predictions) -> Tensor:
        """``[M]`` bool: the head's top-1 draft token equals the target's greedy token."""
        unique, inverse = teacher_positions(batch, preds)
        target_top = self.shared.logits(batch.final.flatten(0, 1)[unique]).argmax(-1)  # full vocabulary
        drafted = torch.cat(
            [
                self.lm.token_ids(self.lm.logits(preds.hidden[part]).argmax(-1))
                for part in chunks(preds.hidden.shape[0], self.chunk_rows)
            ]
        )
        return drafted == target_top[inverse]


def teacher_positions(batch: ExampleBatch, preds: Predictions) -> tuple[Tensor, Tensor]:
    """Distinct flat rows of ``batch.final`` that teach the predictions: ``([U], inverse [M])``."""
    flat = preds.rows * batch.final.shape[1] + preds.positions - 1
    return torch.unique(flat, return_inverse=True)


def chunks(rows: int, size: int) -> list[slice]:
    """``rows`` in consecutive slices of at most ``size``."""
    return [slice(start, start + size) for start in range(0, rows, size)]
