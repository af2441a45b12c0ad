"""The facts a speedup depends on: processor, threads, accelerator, library versions.

A budget that pays off on one machine loses on another (a small tree verifies for about one step
in bf16 on AMX, for about two in fp32 on AVX2), so every results file says where it was measured.
"""

from __future__ import annotations

import os
import platform

import torch
import transformers
from jetflow.core.precision import cpu_kernels, cpu_model, default_device, has_native_bf16

from jetflow import __version__


def describe_machine() -> dict[str, object]:
    device = default_device()
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device.type,
        "accelerator": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "native_bf16": has_native_bf16(device),
        "cpu_kernels": cpu_kernels(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "jetflow": __version__,
    }
