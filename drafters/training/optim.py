"""The optimiser of a run: AdamW with linear warm-up, then a cosine or warm-stable-decay schedule,
over steps whose matrix products may run in a lower precision."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Iterator
from typing import Literal, Self

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn


class OptimConfig(BaseModel):
    """AdamW with linear warm-up, then a decay to ``min_lr_ratio * lr`` by the last step.

    ``cosine`` decays over the whole run. ``wsd`` (warm-up, stable, decay) holds the peak rate
    and decays linearly over the last ``decay_steps`` only: a run can be judged converged at
    the stable rate, and extended with ``--steps`` across sessions, before it anneals.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(default=3e-4, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = Field(default=50, ge=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    grad_clip: float = Field(default=1.0, gt=0)
    schedule: Literal["cosine", "wsd"] = "cosine"
    decay_steps: int = Field(default=0, ge=0, description="wsd: steps of the final linear decay")

    @model_validator(mode="after")
    def _decay_is_given(self) -> Self:
        if self.schedule == "wsd" and self.decay_steps < 1:
            raise ValueError("the wsd schedule needs decay_steps >= 1")
        return self


def lr_factor(step: int, config: OptimConfig, total_steps: int) -> float:
    """Multiplier of the base learning rate at ``step`` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    floor = config.min_lr_ratio
    if config.schedule == "wsd":
        decay_start = max(total_steps - config.decay_steps, config.warmup_steps)
        progress = min(max(step - decay_start, 0) / max(total_steps - decay_start, 1), 1.0)
        return floor + (1 - floor) * (1 - progress)
    progress = min((step - config.warmup_steps) / max(total_steps - config.warmup_steps, 1), 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def restarted_lr_factor(
    optimizer_step: int, restart_step: int, config: OptimConfig, total_steps: int
) -> float:
    """The schedule at the run's step ``restart_step + optimizer_step``.

    After a warm restart (``restart_step > 0``) the optimiser's moments start at zero, so the
    rate re-warms over ``warmup_steps`` while they refill.
    """
    factor = lr_factor(restart_step + optimizer_step, config, total_steps)
    if restart_step and config.warmup_steps:
        factor *= min(1.0, (optimizer_step + 1) / config.warmup_steps)
    return factor


def adamw(parameters: Iterable[nn.Parameter], config: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``parameters``; weight decay applies to matrices only (not norms or biases)."""
    params = list(parameters)
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=config.lr,
        betas=config.betas,
    )


@contextlib.contextmanager
def step_autocast(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Mixed precision for a training step: matrix products in ``dtype`` (fp32: no autocast).

    Norms then see bf16 inputs with fp32 weights, which torch computes correctly on its
    unfused path and warns about on every call; the warning is silenced here only.
    """
    with warnings.catch_warnings(), torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
        yield
