"""The batched verify's attention equals SDPA over repeated key-value heads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from jetflow.attention.ragged_attention import grouped_query_attention


@pytest.mark.parametrize(("heads", "kv_heads", "nodes"), [(9, 3, 1), (9, 3, 5), (4, 4, 3), (8, 1, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_matches_sdpa(heads: int, kv_heads: int, nodes: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(heads * 10 + nodes)
    rows, width, dim, capacity = 3, 11, 16, 14
    query = torch.randn(rows, heads, nodes, dim, generator=generator).to(dtype)
    # the keys are a slice of a slab with spare capacity, as the cache hands them over
    key = torch.randn(rows, kv_heads, capacity, dim, generator=generator).to(dtype)[:, :, :width]
    value = torch.randn(rows, kv_heads, capacity, dim, generator=generator).to(dtype)[:, :, :width]
    visible = torch.rand(rows, 1, nodes, width, generator=generator) > 0.4
    visible[..., 0] = True
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    group = heads // kv_heads
    expected = F.scaled_dot_product_attention(
        query.float(),
        key.float().repeat_interleave(group, 1),
        value.float().repeat_interleave(group, 1),
        attn_mask=visible,
        scale=0.3,
    ).transpose(1, 2)
    out = grouped_query_attention(query, key, value, mask, 0.3)
    assert out.shape == (rows, nodes, heads, dim) and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
