"""The GPU benchmark's logic, run for one tiny cell on the CPU (the kernel interpreted)."""

from __future__ import annotations

import itertools

import pytest
import torch
from jetflow.attention import bench


def _timer(times):
    """A stand-in for the device timer: runs the function once, returns the next of ``times``."""
    source = iter(times)

    def time(fn) -> float:
        fn()
        return next(source)

    return time


def test_one_cell_agrees_and_the_sweep_keeps_the_fastest_tiling(kernels, device) -> None:
    dtype = torch.bfloat16
    # sdpa 3 ms, default tiling 2 ms, then each tiling of the sweep 1.5 ms, one at 0.5 ms
    sweep = [1.5] * len(bench.SWEEP)
    sweep[5] = 0.5
    row = bench.measure(
        "4x2x16", dtype, prefix=20, nodes=10, sweep=True, device=device,
        time_device=_timer([3.0, 2.0, *sweep]), time_host=_timer(itertools.repeat(0.1)),
    )  # fmt: skip
    assert row.agrees and row.max_abs_diff <= bench.TOLERANCE[dtype]
    assert row.speedup == 1.5
    block_n, warps, stages = bench.SWEEP[5]
    assert row.best_tiling == f"n{block_n}/w{warps}/s{stages}" and row.best_ms == 0.5
    table = bench.report([row], {"gpu": "none"})
    assert "| 4x2x16 |" in table and "| 20 | 10 |" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu(tmp_path, capsys) -> None:
    assert bench.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
