"""The trainer under ``torchrun`` with two CPU processes (gloo) equals one process on the same batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jetflow.core.errors import ConfigError
from jetflow.drafters.checkpoint import read_checkpoint
from jetflow.drafters.training.distributed import DataParallel

from tests.training.data_parallel_worker import STEPS, trainer

ROOT = Path(__file__).resolve().parents[2]


def _losses(out: Path) -> dict[int, float]:
    lines = (out / "train_log.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines) if "loss" in record}


def test_two_processes_train_like_one_and_resume(tiny_llama, tmp_path: Path) -> None:
    single = tmp_path / "single"
    torch.set_num_threads(1)
    trainer(tiny_llama, single).fit()

    parallel = tmp_path / "parallel"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(ROOT / "tests/training/data_parallel_worker.py"), str(parallel)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]

    step = f"checkpoints/step-{STEPS:07d}"
    _, expected = read_checkpoint(single / step)
    info, got = read_checkpoint(parallel / step)
    assert info.state["step"] == STEPS
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
    logged = _losses(parallel)
    assert sorted(logged) == list(range(STEPS // 2 + 1, STEPS + 1)), "the resumed run logs once per step"
    expected_losses = {step: loss for step, loss in _losses(single).items() if step in logged}
    assert logged == pytest.approx(expected_losses, rel=1e-4), "the logged loss is the global batch's"


def test_a_global_batch_smaller_than_the_processes_is_refused(tiny_llama, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="one sequence for each of the 8 processes"):
        trainer(tiny_llama, tmp_path, DataParallel(rank=0, world=8))


def test_each_process_gets_its_own_share() -> None:
    items = list(range(7))
    shares = [DataParallel(rank, 3).shard(items) for rank in range(3)]
    assert shares == [[0, 3, 6], [1, 4], [2, 5]]
