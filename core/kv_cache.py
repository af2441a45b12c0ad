"""A KV cache allocated once per generation (or batch) and written in place.

``DynamicCache`` appends by concatenation, copying a layer's whole history at every step: for
one sequence that copy is a sizeable share of a CPU decoding step, and at batch 32 with 400
cached tokens it costs more than the forward itself. A slab holds
``[batch, kv_heads, capacity, head_dim]`` from the start; appending writes in place and
``keys``/``values`` are views of the filled part, so every reader of a ``DynamicLayer`` (mask
sizes, sequence length, crop) works unchanged. The engine commits an accepted tree path by
gathering its entries to the front of the tree's slot (:meth:`SlabLayer.keep`), and the
compiled target (:mod:`jetflow.core.compiled`) writes the same storage from inside its graph.

A batched (ragged) forward attends over the whole storage, not a view of its filled part: a
view ``[:, :, :width]`` of a longer slab is not contiguous, and the bfloat16 matrix products
copy such an operand first, every layer, every step (at 32 rows that copy cost more than the
attention itself). So a batch's slab is sized to the longest row's history in whole granules
(:meth:`SlabLayer.fit`): it grows as the rows do, shrinks when the longest row has left, and
the mask hides the columns a row has not written.
"""

from __future__ import annotations

import torch
from jetflow.attention.ragged_attention import LAYOUT_KEYWORD, RaggedRows
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

#: a batch's slab is sized in whole multiples of this many positions
SLAB_GRANULE = 32


def _granules(positions: int) -> int:
    """``positions`` rounded up to whole :data:`SLAB_GRANULE` s."""
    return -(-positions // SLAB_GRANULE) * SLAB_GRANULE


class SlabLayer(DynamicLayer):
    """A ``DynamicLayer`` over preallocated storage ``[batch, kv_heads, capacity, head_dim]``.

    Each row has its own length (:attr:`lengths`); ``keys``/``values`` expose the first
    ``max(lengths)`` positions of every row, and a reader masks what a shorter row has not written.
    """

    # views of the slabs, set from construction on (a plain layer's are None until its first update)
    keys: Tensor
    values: Tensor

    def __init__(self, key_slab: Tensor, value_slab: Tensor) -> None:
        super().__init__()
        self.key_slab, self.value_slab = key_slab, value_slab
        self.device = key_slab.device
        self.is_initialized = True
        #: the layout of the last ragged write (None after a contiguous one): the target checks
        #: every layer saw the forward's layout
        self.last_layout: RaggedRows | None = None
        self.set_length(0)

    @property
    def rows(self) -> int:
        return int(self.key_slab.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.key_slab.shape[-2])

    @property
    def length(self) -> int:
        """The longest row's length (the width of ``keys``)."""
        return int(self.keys.shape[-2])

    def set_length(self, length: int) -> None:
        """Every row holds its first ``length`` positions."""
        self.set_lengths([length] * self.rows)

    def set_lengths(self, lengths: list[int]) -> None:
        """Row ``r`` holds its first ``lengths[r]`` positions."""
        self.lengths = list(lengths)
        width = max(self.lengths)
        self.keys = self.key_slab[:, :, :width]
        self.values = self.value_slab[:, :, :width]

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Never needed: the storage exists from construction."""

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append ``[batch, kv_heads, n, head_dim]`` after the longest row and return the filled
        part; or, in a ragged forward (``key_states [1, kv_heads, S, head_dim]``), write each token
        at its own row's next position and return the whole storage (``layout.width`` columns)."""
        layout = kwargs.get("kwargs", {}).get(LAYOUT_KEYWORD)
        self.last_layout = layout
        if layout is not None:
            if layout.width != self.capacity:
                raise ValueError(f"a ragged forward attends over {layout.width} columns of {self.capacity}")
            rows, positions = layout.token_rows, layout.token_positions
            self.key_slab[rows, :, positions] = key_states[0].transpose(0, 1)
            self.value_slab[rows, :, positions] = value_states[0].transpose(0, 1)
            self.set_lengths((layout.starts + layout.counts).tolist())
            return self.key_slab, self.value_slab
        start = self.length
        stop = start + key_states.shape[-2]
        self.reserve(stop)
        self.key_slab[:, :, start:stop] = key_states
        self.value_slab[:, :, start:stop] = value_states
        self.set_length(stop)
        return self.keys, self.values

    def reserve(self, positions: int) -> None:
        """Make room for ``positions`` in all; a full slab doubles (one copy, amortised)."""
        if positions > self.capacity:
            self._resize(max(positions, 2 * self.capacity))

    def fit(self, positions: int) -> None:
        """Size the storage for a ragged forward that needs ``positions``: grown by at least an
        eighth when outrun, shrunk when more than a quarter of it would sit unused (a ragged
        forward attends over all of it), in whole granules either way."""
        unused = self.capacity - positions
        if unused < 0:
            self._resize(_granules(max(positions, self.capacity + self.capacity // 8)))
        elif unused > positions // 4 + SLAB_GRANULE:
            self._resize(_granules(positions + positions // 8))

    def _resize(self, capacity: int) -> None:
        """New zeroed storage of ``capacity`` positions holding what every row holds (one copy)."""
        length, lengths = self.length, self.lengths
        resized = [
            slab.new_zeros((*slab.shape[:2], capacity, slab.shape[-1]))
            for slab in (self.key_slab, self.value_slab)
        ]
        for new, old in zip(resized, (self.key_slab, self.value_slab), strict=True):
            new[:, :, :length] = old[:, :, :length]
        self.key_slab, self.value_slab = resized
        self.set_lengths(lengths)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (transformers' negative-count convention)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to drop, got {tokens_to_remove}")
        self.set_lengths([max(length + tokens_to_remove, 0) for length in self.lengths])

    def keep_rows(self, rows: Tensor, starts: list[int], sources: Tensor, lengths: list[int]) -> None:
        """Per moved row ``rows[i]``: move positions ``sources[i]`` (absolute, ascending) to
        ``starts[i], starts[i] + 1, ...``; then every row ``r`` holds ``lengths[r]`` positions.

        ``sources [moved, k]`` is padded past a row's kept count with any positions of the row's
        own tree: what they copy lands beyond the row's new length, where nothing reads it. Rows
        not in ``rows`` move nothing (their kept entries are in place).
        """
        device = self.key_slab.device
        rows = rows.to(device)[:, None]
        sources = sources.to(device)
        targets = torch.tensor(starts, device=device)[:, None] + torch.arange(sources.shape[1], device=device)
        self.key_slab[rows, :, targets] = self.key_slab[rows, :, sources]
        self.value_slab[rows, :, targets] = self.value_slab[rows, :, sources]
        self.set_lengths(lengths)

    def keep(self, start: int, source: Tensor) -> None:
        """Move positions ``source`` (absolute, ascending) to ``start, start + 1, ...`` and drop the rest.

        The gather reads before it writes (advanced indexing copies the few kept rows), so
        overlapping source and destination are safe; the prefix before ``start`` is untouched.
        """
        stop = start + int(source.shape[0])
        self.key_slab[:, :, start:stop] = self.key_slab[:, :, source]
        self.value_slab[:, :, start:stop] = self.value_slab[:, :, source]
        self.set_length(stop)

    def write(self, rows: Tensor, start: int, keys: Tensor, values: Tensor) -> None:
        """Copy another cache's ``keys``/``values`` ``[len(rows), h, n, d]`` into ``rows`` at ``start``."""
        stop = start + keys.shape[-2]
        self.key_slab[rows, :, start:stop] = keys
        self.value_slab[rows, :, start:stop] = values
        lengths = list(self.lengths)
        for row in rows.tolist() if isinstance(rows, Tensor) else [rows]:
            lengths[row] = stop
        self.set_lengths(lengths)

    def batch_select_indices(self, indices: Tensor) -> None:
        self.compact(indices, 0)

    def compact(self, rows: Tensor, drop_front: int) -> None:
        """Keep ``rows`` only and drop the first ``drop_front`` positions (padding in every kept row).

        Attention reads every cached column, so padding that no remaining row needs is
        pure cost; positions are explicit, so the later tokens' rotary phases do not move.
        """
        lengths = [self.lengths[row] - drop_front for row in rows.tolist()]
        self.key_slab = self.key_slab[rows, :, drop_front:]
        self.value_slab = self.value_slab[rows, :, drop_front:]
        self.set_lengths(lengths)

    def reset(self) -> None:
        self.set_length(0)


def slab_cache(model, batch: int, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` for ``model`` whose every layer is a zeroed :class:`SlabLayer`.

    Zeroed, not empty: positions never written are masked out, and a masked score must not
    be computed from NaN garbage.
    """
    config = model.config.get_text_config(decoder=True)
    cache = DynamicCache(config=model.config)
    if not supports_slab(cache):
        raise ValueError("slab caches support full-attention layers only")
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (batch, heads, capacity, head_dim)
    cache.layers = [
        SlabLayer(
            torch.zeros(shape, dtype=model.dtype, device=model.device),
            torch.zeros(shape, dtype=model.dtype, device=model.device),
        )
        for _ in cache.layers
    ]
    return cache


def supports_slab(cache: DynamicCache) -> bool:
    """Whether every layer of ``cache`` is plain full attention (no sliding window, no state)."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def is_slab(cache: DynamicCache) -> bool:
    return slab_layers(cache) is not None


def slab_layers(cache: DynamicCache) -> list[SlabLayer] | None:
    """``cache``'s layers, typed as slabs, when every one is a :class:`SlabLayer`; None otherwise."""
    slabs = [layer for layer in cache.layers if isinstance(layer, SlabLayer)]
    return slabs if slabs and len(slabs) == len(cache.layers) else None
