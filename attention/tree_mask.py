"""The compact tree mask the tree-attention kernel reads instead of a dense float mask.

A verify forward's queries are the tree's ``n`` nodes; its keys are the cached prefix (all
visible) followed by the tree's own ``n`` entries, of which node ``i`` sees only itself and
its ancestors. Only the second part needs a mask, and it is ``n x n`` bits, not
``n x (cached + n)`` floats: row ``i`` packs its ancestor bits into ``ceil(n / 32)`` int32
words (bit ``j % 32`` of word ``j // 32`` is node ``j``).

The kernel also needs the prefix length on the device (so that it reads nothing from the
host and a static cache longer than ``cached + n`` works), so the tensor handed to the
attention function carries it in a header column::

    tree_mask[0, 0, i, 0]      = cached (prefix) length, the same in every row
    tree_mask[0, 0, i, 1 + w]  = ancestor bits of node i for nodes 32 w .. 32 w + 31

Its shape ``[1, 1, n, 1 + words]`` makes transformers pass it through to the attention
function as it is (a 4-D mask counts as prepared), and its dtype (int32) tells it apart
from a dense mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

BITS = 32


def words_for(nodes: int) -> int:
    """int32 words per row of the ancestor bitmask of a tree of ``nodes`` nodes."""
    return -(-nodes // BITS)


def ancestor_bitmask(ancestor: Tensor) -> Tensor:
    """Pack ``[n, n]`` bool (``ancestor[i, j]``: node j is i or an ancestor of i) into
    ``[n, ceil(n / 32)]`` int32 on the same device, bit ``j % 32`` of word ``j // 32``."""
    n = ancestor.shape[0]
    words = words_for(n)
    bits = torch.zeros(n, words * BITS, dtype=torch.int64, device=ancestor.device)
    bits[:, :n] = ancestor.to(torch.int64)
    weights = torch.ones(BITS, dtype=torch.int64, device=ancestor.device) << torch.arange(
        BITS, device=ancestor.device
    )
    packed = (bits.view(n, words, BITS) * weights).sum(dim=-1)  # in [0, 2^32)
    # int32 two's complement: bit 31 set means negative; torch's int64 -> int32 cast is not
    # specified to wrap, so subtract 2^32 explicitly.
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def tree_mask(ancestor: Tensor, n_prefix: int) -> Tensor:
    """The kernel's mask ``[1, 1, n, 1 + words]`` int32: prefix length, then ancestor bits."""
    bitmask = ancestor_bitmask(ancestor)
    header = torch.full((bitmask.shape[0], 1), n_prefix, dtype=torch.int32, device=bitmask.device)
    return torch.cat([header, bitmask], dim=1)[None, None]


def dense_visibility(ancestor: Tensor, n_prefix: int) -> Tensor:
    """The same visibility as a dense ``[n, n_prefix + n]`` bool mask (what SDPA takes)."""
    prefix = torch.ones(ancestor.shape[0], n_prefix, dtype=torch.bool, device=ancestor.device)
    return torch.cat([prefix, ancestor.to(torch.bool)], dim=1)
