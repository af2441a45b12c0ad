"""The compact ancestor bitmask: known words, an exact round trip, the header and the dense form."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from jetflow.attention.tree_mask import ancestor_bitmask, dense_visibility, tree_mask, words_for

from .trees import chain, parent_lists, tree_of


def _unpack(bitmask: torch.Tensor, n: int) -> torch.Tensor:
    """Bit j % 32 of word j // 32, read back one bit at a time (independent of the packing)."""
    nodes = torch.arange(n)
    words = bitmask[:, nodes // 32].to(torch.int64)
    return ((words >> (nodes % 32)) & 1).bool()


def test_chain_words_are_known() -> None:
    bits = ancestor_bitmask(chain(40).ancestor_mask)
    assert bits.dtype == torch.int32 and bits.shape == (40, 2)
    assert bits[0].tolist() == [1, 0]
    assert bits[4].tolist() == [0b11111, 0]
    assert bits[31].tolist() == [-1, 0]  # all 32 bits: bit 31 is the int32 sign bit
    assert bits[39].tolist() == [-1, 0xFF]


def test_star_words_are_known() -> None:
    bits = ancestor_bitmask(tree_of([-1, 0, 0, 0, 0]).ancestor_mask)
    assert bits[:, 0].tolist() == [0b1, 0b11, 0b101, 0b1001, 0b10001]


@settings(max_examples=40, deadline=None)
@given(parents=parent_lists(max_nodes=100))
def test_bitmask_round_trips_to_the_ancestor_matrix(parents) -> None:
    ancestor = tree_of(parents).ancestor_mask
    n = len(parents)
    bits = ancestor_bitmask(ancestor)
    assert bits.shape == (n, words_for(n))
    assert torch.equal(_unpack(bits, n), ancestor)


def test_tree_mask_carries_the_prefix_length_then_the_bits() -> None:
    ancestor = tree_of([-1, 0, 1, 0]).ancestor_mask
    mask = tree_mask(ancestor, 17)
    assert mask.dtype == torch.int32 and mask.shape == (1, 1, 4, 2)
    assert mask[0, 0, :, 0].tolist() == [17] * 4
    assert mask[0, 0, :, 1].tolist() == [0b1, 0b11, 0b111, 0b1001]


def test_dense_visibility_is_prefix_then_ancestors() -> None:
    ancestor = tree_of([-1, 0, 0]).ancestor_mask
    visible = dense_visibility(ancestor, 2)
    assert visible.tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, False, True],
    ]
