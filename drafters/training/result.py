"""What a finished training run reports."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the curve module draws with matplotlib, which a result never needs
    from jetflow.drafters.training.curve import Convergence


@dataclass(frozen=True)
class TrainResult:
    """What a finished run reports (on every process; only the main one evaluates)."""

    steps: int
    wall_s: float  # this run
    train_s: float  # every run that led here (resumes included)
    positions_per_s: float
    final_checkpoint: Path
    evaluation: dict[str, Any]
    main_process: bool = True  # the one that evaluates and writes; the others' evaluation is empty
    convergence: Convergence | None = None  # of the held-out curve, where it was read (by ``train``)
