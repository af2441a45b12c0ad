"""Choice of compute device and dtype from what the hardware offers.

bf16 pays off only with native bf16 matrix units (AMX or AVX-512 BF16 on a CPU, any
recent GPU); elsewhere it is emulated and slower than fp32, so ``auto`` falls back to fp32.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Literal

import torch
from jetflow.core.errors import ConfigError

DtypeName = Literal["auto", "float32", "bfloat16", "float16"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


#: names the device a target loads on (``cuda``, ``cuda:1``, ``cpu``); unset: CUDA where torch sees it
DEVICE_VARIABLE = "JETFLOW_DEVICE"


def default_device() -> torch.device:
    """``$JETFLOW_DEVICE`` if set (``make gpu-check`` sets ``cuda``), else CUDA if available, else the CPU."""
    name = os.environ.get(DEVICE_VARIABLE, "").strip()
    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{DEVICE_VARIABLE}={name!r} is not a torch device (try cuda or cpu)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{DEVICE_VARIABLE}={name} but torch sees no CUDA device "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'})"
        )
    return device


def has_native_bf16(device: torch.device) -> bool:
    """True when bf16 matrix multiplication runs on dedicated hardware and the kernels use it.

    On a CPU the processor must have the units (AMX or AVX-512 BF16) and torch's and oneDNN's
    kernels must not be capped below them (:data:`ISA_CAPS`): under an AVX2 cap bf16 is emulated
    there as on a processor without the units, so ``auto`` takes fp32 as it would there.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    cpu = torch.backends.cpu
    capability = cpu.get_cpu_capability() if hasattr(cpu, "get_cpu_capability") else ""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    units = "AMX" in capability or any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
    uncapped = capability.startswith(("AVX512", "AMX")) and torch.backends.mkldnn.is_available()
    return units and uncapped and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_dtype(name: DtypeName | str, device: torch.device | None = None) -> torch.dtype:
    """The torch dtype for a config value; ``auto`` picks bf16 only where it is native."""
    if name == "auto":
        device = device or default_device()
        return torch.bfloat16 if has_native_bf16(device) else torch.float32
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


#: environment variables that cap the instruction set of torch's, MKL's and oneDNN's CPU kernels:
#: set to AVX2 on an AVX-512 machine (with ``--dtype float32``), they run the kernels of a
#: processor without native bf16, which is how that path is measured where none is at hand
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def cpu_kernels() -> str:
    """The instruction set torch's CPU kernels run (``AVX2``, ``AVX512``, ...), with the caps set
    in the environment (:data:`ISA_CAPS`) after it: figures measured under a cap are emulated."""
    capability = torch.backends.cpu.get_cpu_capability()
    caps = [f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name)]
    return f"{capability} (emulated: {' '.join(caps)})" if caps else capability


def cpu_model() -> str:
    """The processor's name (Linux ``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
