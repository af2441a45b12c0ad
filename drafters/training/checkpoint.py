"""Moved to :mod:`jetflow.drafters.checkpoint` (inference loads heads without importing training/).

Kept so that ``from jetflow.drafters.training.checkpoint import ...`` keeps working.
"""

from jetflow.drafters.checkpoint import (
    CONFIG_FILE,
    FORMAT_VERSION,
    MATCHED_FIELDS,
    WEIGHTS_FILE,
    CheckpointInfo,
    check_target,
    load_checkpoint,
    load_weights,
    read_checkpoint,
    save_checkpoint,
    target_record,
)

__all__ = [
    "CONFIG_FILE",
    "FORMAT_VERSION",
    "MATCHED_FIELDS",
    "WEIGHTS_FILE",
    "CheckpointInfo",
    "check_target",
    "load_checkpoint",
    "load_weights",
    "read_checkpoint",
    "save_checkpoint",
    "target_record",
]
