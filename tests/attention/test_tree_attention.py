"""The Triton tree kernel (in Triton's interpreter) against SDPA with the equivalent dense mask.

The reference mask is built from the tree's ancestor matrix directly, never from the bitmask,
so a wrongly packed bitmask, a kernel reading the wrong bit or the wrong key, a wrong group
head or a broken online softmax all show as a mismatch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jetflow.attention.tree_mask import dense_visibility, tree_mask

from .trees import NO_SHRINK, chain, parent_lists, tree_of

#: (atol, rtol) per dtype: a few units in the last place of outputs of magnitude ~1
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 2e-2)}
DTYPES = list(TOLERANCE)


def _inputs(n, n_prefix, heads, kv_heads, head_dim, dtype, seed, device, extra_keys=0):
    generator = torch.Generator().manual_seed(seed)
    length = n_prefix + n + extra_keys

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    # the query arrives transposed from [1, n, heads, d], as transformers hands it over
    query = draw(1, n, heads, head_dim).transpose(1, 2)
    return query, draw(1, kv_heads, length, head_dim), draw(1, kv_heads, length, head_dim)


def _sdpa(query, key, value, visible, scale=None):
    """SDPA over the keys the dense mask covers, in ``[1, n, heads, d]`` like the kernel."""
    width = visible.shape[-1]
    out = F.scaled_dot_product_attention(
        query,
        key[:, :, :width],
        value[:, :, :width],
        attn_mask=visible[None, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


def _assert_matches(out, expected) -> None:
    atol, rtol = TOLERANCE[expected.dtype]
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@settings(max_examples=30, deadline=None, phases=NO_SHRINK, suppress_health_check=[HealthCheck.too_slow])
@given(
    parents=parent_lists(max_nodes=40),
    n_prefix=st.integers(0, 40),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]),
    head_dim=st.sampled_from([16, 24, 64]),
    dtype=st.sampled_from(DTYPES),
    block_n=st.sampled_from([16, 32]),
    block_m=st.sampled_from([None, 16]),
    seed=st.integers(0, 2**16),
)
def test_kernel_equals_sdpa_with_the_dense_mask(
    kernels, device, parents, n_prefix, kv_heads, group, head_dim, dtype, block_n, block_m, seed
) -> None:
    ancestor = tree_of(parents).ancestor_mask.to(device)
    n = len(parents)
    query, key, value = _inputs(n, n_prefix, kv_heads * group, kv_heads, head_dim, dtype, seed, device)
    out = kernels.tree_attention(
        query, key, value, tree_mask(ancestor, n_prefix), block_m=block_m, block_n=block_n
    )
    _assert_matches(out, _sdpa(query, key, value, dense_visibility(ancestor, n_prefix)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_single_node_tree_sees_the_whole_prefix(kernels, device, dtype, head_dim) -> None:
    ancestor = tree_of([-1]).ancestor_mask.to(device)
    query, key, value = _inputs(1, 37, 4, 2, head_dim, dtype, seed=1, device=device)
    out = kernels.tree_attention(query, key, value, tree_mask(ancestor, 37), block_n=16)
    _assert_matches(out, _sdpa(query, key, value, dense_visibility(ancestor, 37)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_chain_is_causal_attention(kernels, device, dtype) -> None:
    """A chain is a plain causal continuation of the prefix: SDPA's own causal mask agrees."""
    n, n_prefix = 35, 20  # more than 32 nodes: the second bitmask word is read
    query, key, value = _inputs(n, n_prefix, 4, 2, 64, dtype, seed=2, device=device)
    out = kernels.tree_attention(query, key, value, tree_mask(chain(n).ancestor_mask.to(device), n_prefix))
    causal = torch.ones(n, n_prefix + n, dtype=torch.bool, device=device).tril(diagonal=n_prefix)
    _assert_matches(out, _sdpa(query, key, value, causal))


def test_largest_tree_of_256_nodes(kernels, device) -> None:
    parents = [-1] + [(i - 1) // 2 for i in range(1, 256)]  # a binary tree of depth 7
    ancestor = tree_of(parents).ancestor_mask.to(device)
    query, key, value = _inputs(256, 9, 2, 1, 16, torch.float32, seed=3, device=device)
    out = kernels.tree_attention(query, key, value, tree_mask(ancestor, 9))
    _assert_matches(out, _sdpa(query, key, value, dense_visibility(ancestor, 9)))


def test_keys_past_the_tree_are_never_read(kernels, device) -> None:
    """A preallocated cache hands over more keys than prefix + tree: the rest must not count."""
    ancestor = tree_of([-1, 0, 0, 1]).ancestor_mask.to(device)
    query, key, value = _inputs(4, 10, 2, 2, 16, torch.float32, seed=4, device=device, extra_keys=50)
    key[:, :, 14:] = 1e4  # would dominate every softmax if it were read
    out = kernels.tree_attention(query, key, value, tree_mask(ancestor, 10), block_n=16)
    _assert_matches(out, _sdpa(query, key, value, dense_visibility(ancestor, 10)))


def test_custom_scale_is_used(kernels, device) -> None:
    ancestor = tree_of([-1, 0, 1]).ancestor_mask.to(device)
    query, key, value = _inputs(3, 5, 2, 1, 16, torch.float32, seed=5, device=device)
    out = kernels.tree_attention(query, key, value, tree_mask(ancestor, 5), scale=0.3)
    _assert_matches(out, _sdpa(query, key, value, dense_visibility(ancestor, 5), scale=0.3))


def test_every_bit_the_kernel_reads_matters(kernels, device) -> None:
    """Hiding one ancestor from one node changes that node's row alone, exactly as the dense
    mask with the same key hidden says: the kernel follows the bits, not the tree."""
    parents = [-1, 0, 1, 2, 1, 4, *range(5, 38)]  # 39 nodes: node 38 sees bits in both words
    ancestor = tree_of(parents).ancestor_mask.to(device)
    query, key, value = _inputs(39, 6, 2, 1, 16, torch.float32, seed=6, device=device)
    mask = tree_mask(ancestor, 6)
    node, hidden = 38, 33
    assert ancestor[node, hidden]
    mask[0, 0, node, 1 + hidden // 32] ^= 1 << (hidden % 32)
    changed = ancestor.clone()
    changed[node, hidden] = False
    out = kernels.tree_attention(query, key, value, mask, block_n=16)
    _assert_matches(out, _sdpa(query, key, value, dense_visibility(changed, 6)))
    intact = _sdpa(query, key, value, dense_visibility(ancestor, 6))
    differs = (out - intact).abs().amax(dim=(2, 3))[0] > 1e-4
    assert differs.nonzero().flatten().tolist() == [node]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mask_dtype": torch.int64}, "mask must be int32"),
        ({"kv_heads": 3}, "not a multiple"),
        ({"value_dtype": torch.float16}, "share one of"),
    ],
)
def test_bad_arguments_name_what_is_wrong(kernels, device, change, message) -> None:
    ancestor = tree_of([-1, 0]).ancestor_mask.to(device)
    query, key, value = _inputs(2, 3, 4, change.get("kv_heads", 2), 16, torch.float32, seed=7, device=device)
    value = value.to(change.get("value_dtype", torch.float32))
    mask = tree_mask(ancestor, 3).to(change.get("mask_dtype", torch.int32))
    with pytest.raises(ValueError, match=message):
        kernels.tree_attention(query, key, value, mask)
