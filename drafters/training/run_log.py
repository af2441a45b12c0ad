"""A run's ``train_log.jsonl``: one JSON record per logged step and per evaluation.

A resumed run first drops what the interrupted one logged after its last checkpoint, so
the log reads as one uninterrupted run (:mod:`jetflow.drafters.training.curve` reads it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LOG_NAME = "train_log.jsonl"


class RunLog:
    """The JSON-lines log in a run's folder."""

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / LOG_NAME

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    def keep_until(self, step: int) -> None:
        """Drop the records written after ``step`` (by an interrupted run)."""
        if self.path.is_file():
            lines = self.path.read_text(encoding="utf-8").splitlines()
            kept = [line for line in lines if json.loads(line)["step"] <= step]
            self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def clear(self) -> None:
        """Start afresh: a new run in a folder an older one logged to."""
        self.path.unlink(missing_ok=True)
