"""The preallocated KV slab: verify appends in place, commit gathers the path, a full slab grows.

The check that matters: after verify and commit, the slab holds exactly the keys and values
a fresh prefill of prefix + accepted path computes, and nothing after them.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jetflow.core.kv_cache import SlabLayer, is_slab
from jetflow.core.target import Target

from tests.core.test_tree import random_trees

ATOL = 1e-5


@st.composite
def trees_with_a_path(draw):
    prefix = draw(st.lists(st.integers(2, 255), min_size=1, max_size=12))
    tree = draw(random_trees(max_nodes=10))
    capacity = draw(st.integers(1, len(prefix) + tree.size + 4))  # small ones force the slab to grow
    return prefix, tree, draw(st.integers(0, tree.size - 1)), capacity


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=trees_with_a_path())
def test_commit_leaves_the_slab_as_a_prefill_of_the_path(tiny_target: Target, case) -> None:
    prefix, tree, accepted, capacity = case
    cache, _ = tiny_target.prefill(torch.tensor(prefix), capacity=capacity)
    assert is_slab(cache)
    tiny_target.verify(cache, tree)
    path = tree.path(accepted)
    tiny_target.commit(cache, len(prefix), path)
    kept = prefix + tree.tokens[path].tolist()
    expected, _ = tiny_target.prefill(torch.tensor(kept))  # a DynamicCache, computed afresh
    assert cache.get_seq_length() == len(kept)
    for layer, reference in zip(cache.layers, expected.layers, strict=True):
        torch.testing.assert_close(layer.keys, reference.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(layer.values, reference.values, atol=ATOL, rtol=0)


def test_a_full_slab_grows_and_keeps_its_history() -> None:
    keys = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(1, 2, 3, 4)
    layer = SlabLayer(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    layer.update(keys, -keys)
    layer.update(keys[:, :, :2], -keys[:, :, :2])
    assert layer.capacity == 6 and layer.length == 5
    torch.testing.assert_close(layer.keys, torch.cat([keys, keys[:, :, :2]], dim=2))
    torch.testing.assert_close(layer.values, -layer.keys)


def test_keep_gathers_ascending_positions_and_drops_the_rest() -> None:
    slab = torch.arange(8, dtype=torch.float32).reshape(1, 1, 8, 1)
    layer = SlabLayer(slab.clone(), slab.clone())
    layer.set_length(8)
    layer.keep(3, torch.tensor([3, 5, 7]))
    assert layer.keys.flatten().tolist() == [0, 1, 2, 3, 5, 7]
    layer.crop(-2)
    assert layer.length == 4
    with pytest.raises(ValueError, match="negative"):
        layer.crop(1)
