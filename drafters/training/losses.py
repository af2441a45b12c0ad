"""Distillation losses for draft heads, per predicted position, and per-depth weights.

* ``forward-kl`` (default, JetFlow): ``T^2 * KL(p_target^T || q_draft^T)``, both
  distributions softened by temperature ``T``. Mass-covering: the head learns the whole
  ranking of the target, which is what a best-first tree spends its budget on.
* ``sft``: cross-entropy on one label per position. ``sft_labels = "tokens"`` (default) uses
  the sequence's actual next token; on target-regenerated responses that *is* the
  target's greedy token (up to rounding), and it needs no teacher forward at all.
  ``"argmax"`` uses the teacher's argmax instead (identical on regenerated data, differs
  on raw corpora).
* ``reverse-kl``: ``T^2 * KL(q^T || p^T)``, mode-seeking; kept for the ablation.

Depth weights: uniform (JetFlow), or ``exp(-(d - 1) / gamma)`` with ``depth_decay = gamma``
(DFlash's recipe, which favours the early positions that decide acceptance).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

LossKind = Literal["forward-kl", "reverse-kl", "sft"]


class LossConfig(BaseModel):
    """Which loss a run trains with."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: LossKind = "forward-kl"
    temperature: float = Field(default=1.0, gt=0, description="softening of both distributions (KL losses)")
    sft_labels: Literal["tokens", "argmax"] = "tokens"
    depth_decay: float | None = Field(
        default=None, gt=0, description="gamma of exp(-(d-1)/gamma); None: uniform"
    )

    @property
    def needs_teacher(self) -> bool:
        """Whether the loss needs the teacher's distribution (the LM head over ``final``)."""
        return self.kind != "sft" or self.sft_labels == "argmax"


def forward_kl(student_logits: Tensor, teacher_logprobs: Tensor, temperature: float) -> Tensor:
    """``T^2 * KL(p || q)`` per row: ``student_logits [M, V]``, ``teacher_logprobs [M, V]`` at ``T``.

    Written as ``sum p log p - sum p s + logsumexp(s)`` (``s`` the softened student logits,
    ``sum p = 1``): no ``[M, V]`` student log-softmax is materialised, and the gradient
    ``softmax(s) - p`` comes from two passes over the logits instead of four.
    """
    scaled = student_logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    teacher_probs = teacher_logprobs.exp()
    cross = (teacher_probs * scaled).sum(dim=-1)
    neg_entropy = (teacher_probs * teacher_logprobs).sum(dim=-1)
    return temperature**2 * (neg_entropy - cross + torch.logsumexp(scaled, dim=-1))


def reverse_kl(student_logits: Tensor, teacher_logprobs: Tensor, temperature: float) -> Tensor:
    """``T^2 * KL(q || p)`` per row."""
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return temperature**2 * (student.exp() * (student - teacher_logprobs)).sum(dim=-1)


def cross_entropy(student_logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy per row against ``labels [M]``."""
    return F.cross_entropy(student_logits.float(), labels, reduction="none")


def position_losses(
    config: LossConfig, student_logits: Tensor, teacher_logprobs: Tensor | None, labels: Tensor
) -> Tensor:
    """The configured loss per row: ``[M]``. ``teacher_logprobs`` at ``config.temperature``."""
    if not config.needs_teacher:
        return cross_entropy(student_logits, labels)
    if teacher_logprobs is None:
        raise ValueError(f"the {config.kind} loss needs the teacher's log-probabilities")
    if config.kind == "sft":  # on the teacher's argmax
        return cross_entropy(student_logits, teacher_logprobs.argmax(dim=-1))
    if config.kind == "forward-kl":
        return forward_kl(student_logits, teacher_logprobs, config.temperature)
    return reverse_kl(student_logits, teacher_logprobs, config.temperature)


def depth_weights(depths: Tensor, decay: float | None) -> Tensor:
    """Weight of each prediction by its 1-based depth ``[M]``: uniform, or ``exp(-(d-1)/decay)``."""
    if decay is None:
        return torch.ones(depths.shape, dtype=torch.float32, device=depths.device)
    return torch.exp(-(depths.float() - 1) / decay)
