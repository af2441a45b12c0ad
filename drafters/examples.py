"""What a head's training hook reads and returns: a padded batch of anchored sequences, predictions.

These live beside the heads (not in ``training/``) because every head module defines its
``training_predictions(batch, shared) -> Predictions``; the trainer builds the batches
(:func:`jetflow.drafters.training.examples.collate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class ExampleBatch:
    """Sequences padded into one batch, with their anchors.

    Attributes:
        tokens: ``[b, T]`` long, zero padded.
        lengths: ``[b]`` tokens per sequence.
        features: ``[b, F, k, H]`` float, zero padded.
        feature_lengths: ``[b]`` feature rows per sequence.
        final: ``[b, F, H]`` float, zero padded.
        anchors: ``[b, N]`` long (padding anchors are 0).
        anchor_valid: ``[b, N]`` bool.
    """

    tokens: Tensor
    lengths: Tensor
    features: Tensor
    feature_lengths: Tensor
    final: Tensor
    anchors: Tensor
    anchor_valid: Tensor

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def depth_targets(self, max_depth: int) -> tuple[Tensor, Tensor]:
        """Which (anchor, depth) pairs are supervised and the position each predicts.

        Returns ``(valid [b, N, D] bool, positions [b, N, D] long)`` with
        ``positions = anchor + depth``; valid when the token there exists, the teacher
        state before it exists, and the anchor is real.
        """
        depths = torch.arange(1, max_depth + 1, device=self.anchors.device)
        positions = self.anchors[..., None] + depths  # [b, N, D]
        valid = (
            self.anchor_valid[..., None]
            & (positions < self.lengths[:, None, None])
            & (positions <= self.feature_lengths[:, None, None])
        )
        return valid, positions

    def to(self, device: torch.device | str) -> ExampleBatch:
        return ExampleBatch(**{name: value.to(device) for name, value in vars(self).items()})


@dataclass
class Predictions:
    """What a head predicts for one batch, flattened over supervised (anchor, depth) pairs.

    Attributes:
        hidden: ``[M, H]`` head output before the shared LM head (already normed).
        rows: ``[M]`` batch row of each prediction.
        positions: ``[M]`` sequence position of the predicted token (label
            ``tokens[row, position]``, teacher ``final[row, position - 1]``).
        depths: ``[M]`` draft depth, 1-based (for per-depth weights and metrics).
    """

    hidden: Tensor
    rows: Tensor
    positions: Tensor
    depths: Tensor
