"""The preallocated KV slab: verify appends in place, commit gathers the path, a full slab grows.

The check that matters: after verify and commit, the slab holds exactly the keys and values
a fresh prefill of prefix + accepted path computes, and nothing after them.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jetflow.attention.ragged_attention import LAYOUT_KEYWORD, RaggedRows
from jetflow.core.kv_cache import SLAB_GRANULE, SlabLayer, is_slab
from jetflow.core.target import Target
from transformers import DynamicCache

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


def test_a_batch_slab_follows_its_longest_row_in_granules() -> None:
    """Grown by at least an eighth when outrun, shrunk once over a quarter would sit unused,
    in whole granules; every row's history survives each resize."""
    history = torch.arange(2 * 30, dtype=torch.float32).reshape(2, 1, 30, 1)
    layer = SlabLayer(torch.zeros(2, 1, SLAB_GRANULE, 1), torch.zeros(2, 1, SLAB_GRANULE, 1))
    layer.key_slab[:, :, :30] = history
    layer.set_lengths([20, 30])
    sizes = []
    for positions in (30, 40, 7 * SLAB_GRANULE, 90, 100):
        layer.fit(positions)
        sizes.append(layer.capacity)
        torch.testing.assert_close(layer.key_slab[:, :, :30], history)
        assert layer.lengths == [20, 30]
    g = SLAB_GRANULE
    assert sizes == [g, 2 * g, 7 * g, 4 * g, 4 * g]  # 90 needs 3.5 granules: 4 after the shrink


def test_a_ragged_write_attends_over_the_whole_contiguous_slab() -> None:
    """A ragged forward gets the storage itself (a strided view would be copied by every bfloat16
    matrix product), written at each row's own next positions."""
    layer = SlabLayer(torch.zeros(2, 1, 8, 1), torch.zeros(2, 1, 8, 1))
    layer.set_lengths([3, 5])
    layout = RaggedRows.of([3, 5], [2, 1], torch.device("cpu"), width=layer.capacity)
    new = torch.tensor([1.0, 2.0, 3.0]).reshape(1, 1, 3, 1)
    keys, values = layer.update(new, -new, kwargs={LAYOUT_KEYWORD: layout})
    assert keys is layer.key_slab and keys.is_contiguous() and values is layer.value_slab
    assert layer.lengths == [5, 6]
    assert keys[0, 0, 3:5, 0].tolist() == [1.0, 2.0] and keys[1, 0, 5, 0].item() == 3.0
    short = RaggedRows.of([3, 5], [2, 1], torch.device("cpu"))
    with pytest.raises(ValueError, match="columns"):
        layer.update(new, -new, kwargs={LAYOUT_KEYWORD: short})


def _slab_target_cache(rows: int, lengths: list[int]) -> DynamicCache:
    """A cache of two slab layers whose row ``r`` holds positions numbered ``100 r + position``."""
    history = torch.arange(12, dtype=torch.float32) + 100 * torch.arange(rows, dtype=torch.float32)[:, None]
    cache = DynamicCache()
    cache.layers = []
    for _ in range(2):
        slab = history.reshape(rows, 1, 12, 1).clone()
        layer = SlabLayer(slab, -slab)
        layer.set_lengths(lengths)
        cache.layers.append(layer)
    return cache


def test_a_commit_already_in_place_moves_nothing() -> None:
    """Keeping nodes 0..k-1 (the root alone, a chain's first nodes) only sets the length: the
    storage is not written (its version counter does not move); any other path is gathered."""
    cache = _slab_target_cache(1, [8])
    layer = cache.layers[0]
    version = layer.key_slab._version
    Target.commit(cache, 5, torch.tensor([0, 1]))
    assert layer.key_slab._version == version and layer.lengths == [7]
    assert layer.keys.flatten().tolist() == list(range(7))
    Target.commit(cache, 5, torch.tensor([0, 2]))
    assert layer.key_slab._version > version
    assert layer.keys.flatten().tolist() == [0, 1, 2, 3, 4, 5, 7]


def test_commit_rows_moves_only_the_rows_whose_paths_are_out_of_place() -> None:
    cache = _slab_target_cache(3, [9, 9, 9])
    starts = [4, 6, 5]
    paths = [torch.tensor([0]), torch.tensor([0, 2, 3]), None]
    Target.commit_rows(cache, starts, paths)
    for layer in cache.layers:
        assert layer.lengths == [5, 9, 5]
        torch.testing.assert_close(layer.value_slab, -layer.key_slab)
        assert layer.key_slab[0, 0, :5, 0].tolist() == [0, 1, 2, 3, 4]
        assert layer.key_slab[1, 0, :9, 0].tolist() == [100 + p for p in (0, 1, 2, 3, 4, 5, 6, 8, 9)]
        assert layer.key_slab[2, 0, :5, 0].tolist() == [200 + p for p in range(5)]
    version = cache.layers[0].key_slab._version
    Target.commit_rows(cache, [5, 9, 5], [torch.tensor([0, 1]), torch.tensor([0]), None])
    assert cache.layers[0].key_slab._version == version
    assert cache.layers[0].lengths == [7, 10, 5]
