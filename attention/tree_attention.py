"""Tree attention for one verify forward, as a Triton kernel.

Queries are the tree's ``n`` nodes; keys and values are the cached prefix, which every node
sees, followed by the tree's own ``n`` entries, which node ``i`` sees through row ``i`` of an
ancestor bitmask (see :mod:`jetflow.attention.tree_mask`). No dense ``n x (cached + n)`` mask
exists anywhere. Each program owns one tile of query rows of one query head; it streams the
prefix in key blocks with an online softmax (no mask needed there), then the tree's keys up to
its own last row (a node's ancestors come before it in topological order), testing one bit per
score. Grouped-query heads read the key/value head of their group; any head dim up to 256
(padded to a power of two), fp32, fp16 and bf16 inputs, fp32 accumulation.

Triton decides when it is imported, and when ``@triton.jit`` decorates a function, whether
kernels are compiled or interpreted: ``TRITON_INTERPRET=1`` must be set before triton is first
imported (``torch._dynamo`` imports it as soon as transformers loads a model) for the kernel to
run on CPU tensors, as the tests do in a process of their own; :data:`INTERPRETED` says which.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

#: whether this module's kernel runs in Triton's interpreter (CPU tensors) or compiled (GPU)
INTERPRETED: bool = bool(
    triton.knobs.runtime.interpret if hasattr(triton, "knobs") else os.environ.get("TRITON_INTERPRET") == "1"
)

MAX_HEAD_DIM = 256  # one [BLOCK_M, head_dim] fp32 accumulator per program must fit in registers
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _attend_block(
    q,
    k_ptrs,
    v_ptrs,
    load_ok,
    visible,
    m_i,
    l_i,
    acc,
    qk_scale,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One key block of the online softmax: scores, running max, rescaled sums and output."""
    k = tl.load(k_ptrs, mask=load_ok, other=0.0)
    v = tl.load(v_ptrs, mask=load_ok, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 domain
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(
    Q,
    K,
    V,
    Mask,
    Out,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_mb,
    stride_mm,
    stride_ob,
    stride_om,
    stride_oh,
    n_nodes,
    n_heads,
    group,
    head_dim,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = batch_head // n_heads
    h = batch_head % n_heads
    kv_h = h // group

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_nodes
    dim_ok = dims < head_dim

    q_ptrs = Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    mask_rows = Mask + b * stride_mb + rows * stride_mm
    n_prefix = tl.load(Mask + b * stride_mb)  # header column of row 0
    k_base = K + b * stride_kb + kv_h * stride_kh + dims[None, :]
    v_base = V + b * stride_vb + kv_h * stride_vh + dims[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # The cached prefix: every key is visible to every row.
    for start in range(0, n_prefix, BLOCK_N):
        keys = start + cols
        key_ok = keys < n_prefix
        m_i, l_i, acc = _attend_block(
            q,
            k_base + keys[:, None] * stride_kn,
            v_base + keys[:, None] * stride_vn,
            key_ok[:, None] & dim_ok[None, :],
            key_ok[None, :],
            m_i,
            l_i,
            acc,
            qk_scale,
            DOT_FP32,
            PRECISION,
        )

    # The tree's own entries, through the ancestor bits; none after this tile's last row.
    tree_end = tl.minimum(n_nodes, (tile + 1) * BLOCK_M)
    for start in range(0, tree_end, BLOCK_N):
        nodes = start + cols
        node_ok = nodes < n_nodes
        words = tl.load(
            mask_rows[:, None] + 1 + (nodes // 32)[None, :],
            mask=row_ok[:, None] & node_ok[None, :],
            other=0,
        )
        visible = ((words >> (nodes % 32)[None, :]) & 1) != 0
        keys = n_prefix + nodes
        m_i, l_i, acc = _attend_block(
            q,
            k_base + keys[:, None] * stride_kn,
            v_base + keys[:, None] * stride_vn,
            node_ok[:, None] & dim_ok[None, :],
            visible,
            m_i,
            l_i,
            acc,
            qk_scale,
            DOT_FP32,
            PRECISION,
        )

    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # padding rows only: every node sees itself
    out = acc / l_i[:, None]
    o_ptrs = Out + b * stride_ob + rows[:, None] * stride_om + h * stride_oh + dims[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _block_m(n_nodes: int) -> int:
    """Query rows per program: the tree rounded up to 16 (``tl.dot``'s least), at most 64."""
    return min(64, max(16, triton.next_power_of_2(n_nodes)))


def default_tiling(block_m: int, block_d: int, dtype: torch.dtype) -> tuple[int, int]:
    """Keys per block and warps per program, chosen so that sm_90 code spills no registers
    (checked by compiling for sm_90 without a GPU): 16-bit inputs take 64 keys (32 for the largest
    tile, 64 rows of head dim 128; 128 keys spill at every size), fp32 inputs, whose exact dots
    run on the FMA units, take 16."""
    if dtype == torch.float32:
        return 16, 4
    return (32 if block_m * block_d >= 64 * 128 else 64), (4 if block_d <= 64 else 8)


def tree_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor,
    scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> Tensor:
    """Attention of the tree's nodes over the prefix and their ancestors.

    Args:
        query: ``[batch, heads, n, head_dim]`` the tree nodes' queries (any strides with unit
            stride in the last dim).
        key, value: ``[batch, kv_heads, length, head_dim]`` with ``length >= prefix + n``: the
            cached prefix, then the tree's entries (entries past them are never read).
        mask: ``[1 or batch, 1, n, 1 + ceil(n / 32)]`` int32 from
            :func:`jetflow.attention.tree_mask.tree_mask` (prefix length, then ancestor bits).
        scale: softmax scale, ``head_dim ** -0.5`` by default.
        block_m, block_n, num_warps, num_stages: tiling, by default :func:`_block_m` and
            :func:`default_tiling` (the tests use small blocks to cross block edges on tiny
            shapes; the benchmark sweeps them).

    Returns:
        ``[batch, n, heads, head_dim]`` in the query's dtype (the layout transformers'
        attention functions return).
    """
    batch, heads, n, head_dim = query.shape
    kv_heads = key.shape[1]
    _check(query, key, value, mask)
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    mask = mask[:, 0]
    out = torch.empty(batch, n, heads, head_dim, dtype=query.dtype, device=query.device)
    block_m = block_m or _block_m(n)
    block_d = max(16, triton.next_power_of_2(head_dim))
    default_n, default_warps = default_tiling(block_m, block_d, query.dtype)
    log2e = 1.4426950408889634
    qk_scale = (scale if scale is not None else head_dim**-0.5) * log2e
    grid = (triton.cdiv(n, block_m), batch * heads)
    _tree_attention_kernel[grid](
        query,
        key,
        value,
        mask,
        out,
        query.stride(0),
        query.stride(1),
        query.stride(2),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        mask.stride(0) if mask.shape[0] > 1 else 0,
        mask.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        n,
        heads,
        heads // kv_heads,
        head_dim,
        qk_scale,
        BLOCK_M=block_m,
        BLOCK_N=block_n or default_n,
        BLOCK_D=block_d,
        # The interpreter multiplies bf16 tiles as their raw 16-bit patterns in tl.dot
        # (triton 3.9), so it computes bf16 dots in fp32; compiled kernels use bf16 tensor cores.
        DOT_FP32=INTERPRETED and query.dtype == torch.bfloat16,
        # fp32 inputs multiply exactly like SDPA's fp32 matmuls (no tf32); 16-bit ones ignore it
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps or default_warps,
        num_stages=num_stages,
        enable_fp_fusion=True,  # multiply-adds fused, as triton has defaulted to so far
    )
    return out


def _check(query: Tensor, key: Tensor, value: Tensor, mask: Tensor) -> None:
    """Shape and dtype agreement, with messages that name the offending argument."""
    batch, heads, n, head_dim = query.shape
    if key.shape != value.shape or key.dim() != 4 or key.shape[0] != batch or key.shape[3] != head_dim:
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} do not fit query {tuple(query.shape)}"
        )
    if heads % key.shape[1]:
        raise ValueError(f"{heads} query heads are not a multiple of {key.shape[1]} key/value heads")
    if not query.dtype == key.dtype == value.dtype or query.dtype not in DTYPES:
        raise ValueError(
            f"query, key and value must share one of fp32/fp16/bf16, got {query.dtype}, {key.dtype}"
        )
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is over {MAX_HEAD_DIM}")
    words = -(-n // 32)
    if mask.dtype != torch.int32 or mask.dim() != 4 or tuple(mask.shape[1:]) != (1, n, 1 + words):
        raise ValueError(f"mask must be int32 [1, 1, {n}, {1 + words}], got {mask.dtype} {tuple(mask.shape)}")
    if (query.device.type == "cpu") != INTERPRETED:
        raise ValueError(
            f"tensors on {query.device} but the kernel is {'interpreted' if INTERPRETED else 'compiled'}: "
            "CPU tensors need TRITON_INTERPRET=1 before jetflow.attention.tree_attention is imported"
        )
