"""Where jetflow keeps the files it derives (de-quantised targets, calibrations, compiled graphs).

A module of its own because every layer needs it (the target, the compiled forward, the
calibration store, the feature cache) and none of them should import another for it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where jetflow keeps derived files; ``JETFLOW_CACHE`` overrides ``~/.cache/jetflow``."""
    return Path(os.environ.get("JETFLOW_CACHE", Path.home() / ".cache" / "jetflow"))
