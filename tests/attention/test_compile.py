"""The kernel compiles for Hopper (sm_90, the H100/H200) on a machine without a GPU.

Triton's interpreter accepts code the compiler rejects (and the reverse), so the interpreted
equality tests alone cannot show that the kernel builds for a GPU. Triton compiles ahead of time
for a named target with its bundled ``ptxas``, no GPU needed; this runs in the ordinary test
process (where triton compiles), not in the interpreter child.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.compiled

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CASES = [  # (dtype, head_dim, nodes): the largest tile (tensor cores), the smallest (exact fp32)
    ("bf16", 128, 256),
    ("fp32", 64, 16),
]


@pytest.mark.parametrize(("dtype", "head_dim", "nodes"), CASES)
def test_kernel_compiles_for_sm90(dtype, head_dim, nodes, tmp_path, monkeypatch) -> None:
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton build has no NVIDIA backend")
    import triton
    from jetflow.attention import tree_attention as kernels
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if kernels.INTERPRETED:
        pytest.skip("needs a process in which triton compiles (TRITON_INTERPRET is set)")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fn = kernels._tree_attention_kernel
    block_m = kernels._block_m(nodes)
    block_d = triton.next_power_of_2(head_dim)
    block_n, warps = kernels.default_tiling(block_m, block_d, getattr(torch, TORCH_DTYPES[dtype]))
    constants = {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_D": block_d,
        "DOT_FP32": False,
        "PRECISION": "ieee" if dtype == "fp32" else "tf32",
    }
    signature = {name: "i32" for name in fn.arg_names}
    signature.update({name: f"*{dtype}" for name in ("Q", "K", "V", "Out")}, Mask="*i32", qk_scale="fp32")
    signature.update(dict.fromkeys(constants, "constexpr"))
    compiled = triton.compile(
        ASTSource(fn, signature, constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": 2, "enable_fp_fusion": True},
    )
    assert compiled.asm["cubin"]
    # 16-bit inputs multiply on tensor cores; fp32 ones exactly (ieee), on the FMA units
    assert ("mma" in compiled.asm["ptx"]) == (dtype != "fp32")
