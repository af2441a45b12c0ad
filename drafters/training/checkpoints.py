"""A run's resumable checkpoints: the head's weights beside the optimiser, schedule and clock.

Layout under the run's folder::

    checkpoints/step-0000500/    fp32 weights + config.json (a head checkpoint) + trainer.pt

A folder counts once both its ``config.json`` and ``trainer.pt`` exist; the oldest go once
more than ``keep`` are left. Loading weights into a head checks first that they fit it: the
same architecture, and (given the target) the same target.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from jetflow.core.errors import CheckpointMismatchError
from jetflow.core.target import Target
from jetflow.drafters.checkpoint import (
    CONFIG_FILE,
    CheckpointInfo,
    check_target,
    read_checkpoint,
    save_checkpoint,
)
from jetflow.drafters.training.contracts import TrainableHead

#: the file of a checkpoint folder that makes it resumable
TRAINER_STATE = "trainer.pt"


@dataclass(frozen=True)
class ResumeState:
    """What a resumable checkpoint holds beside the head.

    Attributes:
        step: optimiser steps taken.
        optimizer: the optimiser's state dict (the moments).
        scheduler: the learning-rate scheduler's state dict.
        train_s: seconds of training up to ``step``, over every run that led here.
        restart_step: the step a warm restart began at (0: none); the schedule re-warms from it.
    """

    step: int
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    train_s: float
    restart_step: int

    @classmethod
    def read(cls, folder: Path) -> ResumeState:
        saved = torch.load(folder / TRAINER_STATE, weights_only=True)
        return cls(
            step=int(saved["step"]),
            optimizer=saved["optimizer"],
            scheduler=saved["scheduler"],
            train_s=float(saved.get("train_s", 0.0)),
            restart_step=int(saved.get("restart_step", 0)),
        )


class RunCheckpoints:
    """The resumable checkpoints under ``out/checkpoints``, newest last."""

    def __init__(self, out: Path, keep: int) -> None:
        self.root = Path(out) / "checkpoints"
        self.keep = keep

    def folder(self, step: int) -> Path:
        return self.root / f"step-{step:07d}"

    def save(self, head: TrainableHead, info: CheckpointInfo, state: ResumeState) -> Path:
        """Write a resumable checkpoint of ``state.step``; the oldest beyond ``keep`` go."""
        folder = save_checkpoint(self.folder(state.step), head.state_dict(), info)
        torch.save(dict(vars(state)), folder / TRAINER_STATE)  # vars: no copy of the moments
        for old in self.saved()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return folder

    def saved(self) -> list[Path]:
        """The complete checkpoint folders, oldest first."""
        found = [
            p
            for p in self.root.glob("step-*")
            if (p / TRAINER_STATE).is_file() and (p / CONFIG_FILE).is_file()
        ]
        return sorted(found)

    def latest(self) -> Path | None:
        saved = self.saved()
        return saved[-1] if saved else None


def load_head(
    head: TrainableHead, folder: Path, expected: CheckpointInfo, target: Target | None, purpose: str
) -> CheckpointInfo:
    """Load the weights of checkpoint ``folder`` into ``head``, after checking they fit this run.

    ``expected`` describes the run (drafter, architecture); with ``target``, the checkpoint
    must also have been trained for it. ``purpose`` ("resume", "warm-start") names the refusal.
    """
    info, state = read_checkpoint(folder)
    if target is not None:
        check_target(info, target, source=f"checkpoint {folder}", drafter=expected.drafter)
    if info.architecture != expected.architecture:
        raise CheckpointMismatchError(
            f"cannot {purpose} from {folder}: it was trained as head {info.architecture}, "
            f"this run asks for {expected.architecture}"
        )
    head.load_state_dict(state)
    return info
