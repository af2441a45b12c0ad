"""The no-bf16 path on any x86 machine: the instruction-set caps make torch run AVX2 kernels."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from jetflow.core.precision import ISA_CAPS, cpu_kernels

PROBE = (
    "import torch; from jetflow.core.precision import cpu_kernels, resolve_dtype; "
    "print(cpu_kernels()); print(resolve_dtype('auto', torch.device('cpu')))"
)


def test_cpu_kernels_names_the_instruction_set_and_any_cap(monkeypatch) -> None:
    for name in ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    assert cpu_kernels() == torch.backends.cpu.get_cpu_capability()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_kernels().endswith("(emulated: ONEDNN_MAX_CPU_ISA=AVX2)")


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="not an x86 CPU with AVX2"
)
def test_the_caps_make_a_fresh_process_run_avx2_kernels_in_fp32() -> None:
    caps = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env={**os.environ, **caps}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    kernels, dtype = done.stdout.strip().splitlines()
    assert kernels.startswith("AVX2 (emulated: ATEN_CPU_CAPABILITY=avx2")
    assert dtype == "torch.float32"  # bf16 would be emulated there: `auto` takes fp32
