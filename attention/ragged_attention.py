"""One target forward for the trees of many sequences: tokens flattened, attention per row.

A batch of trees of different sizes is run as one flattened sequence ``[1, S]`` (S = the sum of
the trees' nodes), so every linear layer sees exactly the tokens there are and no padding: the
forward costs what the sum of the trees costs. Only attention is per sequence. The KV cache is a
slab ``[rows, kv_heads, capacity, head_dim]`` (:mod:`jetflow.core.kv_cache`) in which each row has
its own length; the cache writes each new token's keys at its row's next positions, and the
attention function registered here gathers the flattened queries into a padded
``[rows, nodes, ...]`` block, attends over the slab under a ``[rows, 1, nodes, width]`` mask
(a node sees its row's cached prefix and its own ancestors; padding sees one column and is
dropped), and scatters the outputs back. The layout travels with the forward as the model
keyword :data:`LAYOUT_KEYWORD`, which transformers hands to the cache update and the attention.

A forward without the keyword (prefill, a single sequence) runs the attention the model had.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

#: the model keyword that carries a :class:`RaggedRows` through one forward
LAYOUT_KEYWORD = "ragged_rows"
#: the attention implementations registered with transformers start so (then the one they wrap)
IMPLEMENTATION = "jetflow_ragged"


@dataclass(frozen=True)
class RaggedRows:
    """Where the tokens of one flattened forward belong.

    Attributes:
        starts: ``[rows]`` each slab row's cached length, where its new tokens are written.
        counts: ``[rows]`` new tokens of each row (0 for a row that sits this forward out).
        token_rows: ``[S]`` slab row of each flattened token.
        token_positions: ``[S]`` cache position of each flattened token.
        slots: ``[rows, nodes]`` flattened index of each padded slot (0 where padding).
        valid: ``[rows, nodes]`` which padded slots hold a token.
        width: key columns attended: the slab's whole storage, at least the longest row after
            the write (columns past a row's own length are masked).
    """

    starts: Tensor
    counts: Tensor
    token_rows: Tensor
    token_positions: Tensor
    slots: Tensor
    valid: Tensor
    width: int

    @classmethod
    def of(
        cls, starts: Sequence[int], counts: Sequence[int], device: torch.device, width: int = 0
    ) -> RaggedRows:
        """The layout of rows with ``starts`` cached positions receiving ``counts`` tokens each,
        attending over ``width`` key columns (at least the longest row after the write)."""
        starts_t = torch.tensor(starts, dtype=torch.long, device=device)
        counts_t = torch.tensor(counts, dtype=torch.long, device=device)
        nodes = max(max(counts), 1)
        local = torch.arange(nodes, device=device)
        valid = local[None, :] < counts_t[:, None]
        offsets = torch.cumsum(counts_t, 0) - counts_t
        slots = torch.where(valid, offsets[:, None] + local[None, :], 0)
        rows = torch.arange(len(starts), device=device)[:, None].expand_as(valid)
        return cls(
            starts=starts_t,
            counts=counts_t,
            token_rows=rows[valid],
            token_positions=(starts_t[:, None] + local[None, :])[valid],
            slots=slots,
            valid=valid,
            width=max(width, *(s + c for s, c in zip(starts, counts, strict=True))),
        )

    @property
    def nodes(self) -> int:
        return int(self.valid.shape[1])

    def visibility(self, ancestors: Sequence[Tensor | None]) -> Tensor:
        """``[rows, nodes, width]`` bool: the cached prefix of its row and its own ancestors.

        ``ancestors``: each row's ``[n, n]`` ancestor mask (None for a row without tokens). A
        padding slot sees column 0 only (a row that sees nothing would give NaN scores).
        """
        rows, nodes, device = self.valid.shape[0], self.nodes, self.valid.device
        tree = torch.zeros(rows, nodes, nodes, dtype=torch.bool, device=device)
        for row, mask in enumerate(ancestors):  # a copy per row, not per token
            if mask is not None:
                n = mask.shape[0]
                tree[row, :n, :n] = mask.to(device)
        columns = torch.arange(self.width, device=device)
        visible = columns[None, None, :] < self.starts[:, None, None]
        visible = visible.expand(rows, nodes, self.width).clone()
        targets = (self.starts[:, None] + torch.arange(nodes, device=device)).clamp(max=self.width - 1)
        placed = torch.zeros(rows, nodes, self.width, dtype=torch.long, device=device)
        placed.scatter_add_(2, targets[:, None, :].expand(rows, nodes, nodes), tree.long())
        visible |= placed > 0
        visible[:, :, 0] |= ~self.valid
        return visible


def ragged_attention_forward(
    fallback: Callable[..., tuple[Tensor, Tensor | None]],
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention-function contract; per-row SDPA when the forward is ragged.

    ``query [1, heads, S, d]`` flattened; ``key``/``value`` the slab's rows ``[rows, kv, width, d]``.
    Without a layout it is ``fallback``, the attention the model ran before.
    """
    layout: RaggedRows | None = kwargs.pop(LAYOUT_KEYWORD, None)
    if layout is None:
        return fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    padded = query[0][:, layout.slots].transpose(0, 1)  # [rows, heads, nodes, d]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = grouped_query_attention(padded, key, value, attention_mask, scale)  # [rows, nodes, heads, d]
    return out[layout.valid][None], None


def grouped_query_attention(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float
) -> Tensor:
    """Attention of a few queries per row over a long cache, every key-value head read once.

    ``query [rows, heads, nodes, d]``, ``key``/``value [rows, kv_heads, width, d]``, ``mask`` additive
    ``[rows, 1, nodes, width]``; returns ``[rows, nodes, heads, d]``. The query heads that share a
    key-value head are stacked as rows of one matrix product against it. SDPA with a mask first
    copies each key-value head once per query head it serves and runs a kernel blocked for long
    query runs; with a handful of tree nodes per row and hundreds of cached positions both cost
    more than the products themselves. Softmax runs in float32 whatever the dtype.
    """
    rows, heads, nodes, dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scores = torch.matmul(query.reshape(rows, kv_heads, group * nodes, dim), key.transpose(-1, -2))
    scores = scores.view(rows, kv_heads, group, nodes, width).mul_(scaling)
    if mask is not None:
        scores.add_(mask[:, :, None])
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs.view(rows, kv_heads, group * nodes, width), value)
    return out.view(rows, heads, nodes, dim).transpose(1, 2)


def enable_ragged_attention(model: PreTrainedModel) -> None:
    """Switch ``model`` to :func:`ragged_attention_forward` over the attention it runs now (SDPA,
    or the tree kernel on CUDA), whose masks it keeps."""
    current = model.config._attn_implementation or "sdpa"
    if current.startswith(IMPLEMENTATION):
        return
    fallback = sdpa_attention_forward if current == "sdpa" else ALL_ATTENTION_FUNCTIONS.get(current)
    if fallback is None or current not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"batched verification wraps sdpa attention; the model uses {current!r}")
    name = f"{IMPLEMENTATION}_{current}"
    AttentionInterface.register(name, partial(ragged_attention_forward, fallback))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    model.set_attn_implementation(name)
