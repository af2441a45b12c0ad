"""One process of the data-parallel training test (started by ``torchrun``, not collected by pytest).

Trains the tiny head for half the steps, writes a resumable checkpoint as an interrupted
run would, then resumes from it in a fresh trainer and finishes: the test compares the
result with one process training on the same global batches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from jetflow.drafters.blocks import FrozenTargetParts
from jetflow.drafters.training.distributed import DataParallel
from jetflow.drafters.training.trainer import Trainer

from tests.conftest import make_tiny_target
from tests.drafters.tiny_heads import head_info, quick_config, regenerated_store, tiny_head

STEPS = 6
# fp32: the summed shard gradients equal the whole batch's only to fp32 rounding (bf16 rounds per shape)
SETTINGS = {
    "steps": STEPS,
    "batch_sequences": 4,
    "log_every": 1,
    "holdout_sequences": 4,
    "precision": "float32",
}


def trainer(target, out: Path, parallel: DataParallel | None = None) -> Trainer:
    """The tiny head's trainer: the same in the test's single process and in each rank."""
    head = tiny_head(target, path_conditioning=0.5)  # the revealed slots are random draws too
    shared = FrozenTargetParts.from_target(target)
    store, info = regenerated_store(target), head_info(target, head)
    config = quick_config(**SETTINGS)
    return Trainer(config, head, shared, store, info, out=out, progress=False, parallel=parallel)


def main(out: Path) -> None:
    torch.set_num_threads(1)
    parallel = DataParallel.from_env()
    target = make_tiny_target("llama")
    first = trainer(target, out, parallel)
    for _ in range(STEPS // 2):
        first.train_step()
    if parallel.is_main:
        first.save()
    parallel.barrier()
    trainer(target, out, parallel).fit(resume=True)
    parallel.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
