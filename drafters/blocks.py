"""Building blocks shared by the learned draft heads (JetFlow, DFlash, EAGLE).

* :class:`FeatureFusion`: concatenated hidden states of k target layers -> one vector per token.
* :class:`DecoderLayer`: pre-norm attention + SwiGLU MLP whose attention takes *injected
  context keys/values*: the context's fused target features, projected by the layer's own
  k/v projections, sit in front of the block's keys/values, so the target's features act
  as the head's KV cache.
* :class:`Rotary`: rotary position embedding at absolute positions.
* :class:`FrozenTargetParts`: the target's token embedding and LM head, used frozen and
  held outside the head's parameters so a checkpoint never contains them;
  :class:`DraftLMHead` is that LM head laid out for drafting, optionally restricted to a
  draft vocabulary.

Attention masks are explicit booleans ``[batch, queries, context + queries]`` (true =
may attend), so one code path serves causal blocks, bidirectional blocks, many blocks per
sequence during training and tree-shaped blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from jetflow.core.errors import TargetError
from jetflow.core.packed_weights import PackedLinear, packed_or_plain
from torch import Tensor, nn

if TYPE_CHECKING:
    from jetflow.core.target import Target

KV = tuple[Tensor, Tensor]  # keys, values: [batch, kv_heads, n, head_dim] each


@dataclass(frozen=True)
class AttentionShape:
    """Sizes of one decoder layer."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    qk_norm: bool = True


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half convention) at arbitrary absolute positions."""

    inv_freq: Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``positions [b, n]`` -> ``(cos, sin)`` each ``[b, 1, n, head_dim]`` (float32)."""
        angles = positions.to(torch.float32)[..., None] * self.inv_freq  # [b, n, d/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None]
        return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, rotary: tuple[Tensor, Tensor]) -> Tensor:
    """Rotate ``x [b, heads, n, d]`` by ``rotary`` (``cos, sin [b, 1, n, d]``)."""
    cos, sin = rotary
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class FeatureFusion(nn.Module):
    """k target layers' hidden states -> one hidden vector: bias-free Linear(k*H -> H) + RMSNorm."""

    def __init__(self, n_layers: int, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.proj = nn.Linear(n_layers * hidden_size, hidden_size, bias=False)
        #: an EAGLE-3 layout replaces it by ``nn.Identity`` (its layer normalises every state)
        self.norm: nn.Module = nn.RMSNorm(hidden_size, eps=eps)

    def forward(self, features: Tensor) -> Tensor:
        """``features [..., k, H]`` -> ``[..., H]``."""
        return self.norm(self.proj(features.flatten(-2)))


class ContextAttention(nn.Module):
    """Grouped-query attention over ``[context keys/values ; block keys/values]``."""

    def __init__(self, shape: AttentionShape) -> None:
        super().__init__()
        self.shape = shape
        hidden, d = shape.hidden_size, shape.head_dim
        self.q_proj = nn.Linear(hidden, shape.num_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, shape.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, shape.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * d, hidden, bias=False)
        norm = (lambda: nn.RMSNorm(d, eps=shape.rms_norm_eps)) if shape.qk_norm else nn.Identity
        self.q_norm, self.k_norm = norm(), norm()

    def _heads(self, x: Tensor, heads: int) -> Tensor:
        """``[b, n, heads * d]`` -> ``[b, heads, n, d]``."""
        return x.unflatten(-1, (heads, self.shape.head_dim)).transpose(1, 2)

    def project_kv(self, x: Tensor, rotary: tuple[Tensor, Tensor]) -> KV:
        """Keys and values of ``x [b, n, H]`` (rotated at their positions): ``[b, kv_heads, n, d]``."""
        keys = self.k_norm(self._heads(self.k_proj(x), self.shape.num_kv_heads))
        values = self._heads(self.v_proj(x), self.shape.num_kv_heads)
        return apply_rotary(keys, rotary), values

    def forward(self, x: Tensor, rotary: tuple[Tensor, Tensor], context: KV, mask: Tensor) -> Tensor:
        """``x [b, q, H]`` attends to ``context`` (``[b, kv, c, d]``) then itself; ``mask [b, q, c + q]``."""
        queries = apply_rotary(self.q_norm(self._heads(self.q_proj(x), self.shape.num_heads)), rotary)
        keys, values = self.project_kv(x, rotary)
        keys = torch.cat([context[0], keys], dim=2)
        values = torch.cat([context[1], values], dim=2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[:, None], enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention with injected context keys/values, then a SwiGLU MLP."""

    def __init__(self, shape: AttentionShape) -> None:
        super().__init__()
        self.input_norm = nn.RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.attn = ContextAttention(shape)
        self.post_norm = nn.RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.mlp = SwiGLU(shape.hidden_size, shape.intermediate_size)

    def context_kv(self, fused: Tensor, rotary: tuple[Tensor, Tensor]) -> KV:
        """This layer's keys/values of fused context features ``[b, c, H]`` -> ``[b, kv, c, d]``.

        The features are not re-normalised per layer: the fusion's RMSNorm already did.
        """
        return self.attn.project_kv(fused, rotary)

    def forward(self, x: Tensor, rotary: tuple[Tensor, Tensor], context: KV, mask: Tensor) -> Tensor:
        """``x [b, q, H]`` -> ``[b, q, H]``."""
        x = x + self.attn(self.input_norm(x), rotary, context, mask)
        return x + self.mlp(self.post_norm(x))


@dataclass(frozen=True, eq=False)
class FrozenTargetParts:
    """The target's token embedding and LM head: shared, frozen, never part of a head's weights."""

    embed_tokens: nn.Module
    lm_head: nn.Linear

    @classmethod
    def from_target(cls, target: Target) -> FrozenTargetParts:
        lm_head = target.model.get_output_embeddings()
        if not isinstance(lm_head, nn.Linear):
            raise TargetError(f"the target's LM head is a {type(lm_head).__name__}; heads share a linear one")
        return cls(target.model.get_input_embeddings(), lm_head)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def embed(self, ids: Tensor) -> Tensor:
        """``ids [...]`` -> ``[..., H]``."""
        return self.embed_tokens(ids)

    def logits(self, hidden: Tensor) -> Tensor:
        """``hidden [..., H]`` (already normed) -> ``[..., vocab]``."""
        return self.lm_head(hidden.to(self.dtype))


@dataclass(frozen=True, eq=False)
class DraftLMHead:
    """The target's frozen LM head, optionally restricted to a draft vocabulary (EAGLE-3 style).

    The weight is kept transposed and contiguous (``[H, N]``): a skinny ``[15, H] @ [H, N]``
    product is ~3x faster on CPU than ``F.linear`` against the ``[N, H]`` layout; where the
    target's weights are packed for oneDNN (CPU bf16) the rows are packed once as well
    (:mod:`jetflow.core.packed_weights`), the same kernel without a reorder per call. With a
    draft vocabulary of the ``N`` most frequent tokens the product shrinks by ``V / N``;
    tokens outside it are never drafted (verification keeps the output lossless), and the
    softmax over the subset is the target's distribution renormalised onto it.

    Attributes:
        weight_t: ``[H, N]`` frozen rows of the LM head, transposed.
        bias: ``[N]`` or None.
        tokens: ``[N]`` vocabulary id of each column, or None for the full vocabulary.
        packed: the rows packed for oneDNN, or None where packing does not serve them.
    """

    weight_t: Tensor
    bias: Tensor | None
    tokens: Tensor | None
    packed: PackedLinear | None = None

    @classmethod
    def build(cls, lm_head: nn.Linear, tokens: Tensor | None = None) -> DraftLMHead:
        weight = lm_head.weight.detach()
        bias = None if lm_head.bias is None else lm_head.bias.detach()
        if tokens is not None:
            tokens = tokens.to(weight.device)
            weight = weight[tokens]
            bias = None if bias is None else bias[tokens]
        weight_t = weight.T.contiguous()
        return cls(weight_t, bias, tokens, packed_or_plain(weight, bias, transposed=weight_t))

    @property
    def size(self) -> int:
        return int(self.weight_t.shape[1])

    def logits(self, hidden: Tensor) -> Tensor:
        """``hidden [..., H]`` (already normed) -> ``[..., N]`` over the draft vocabulary."""
        hidden = hidden.to(self.weight_t.dtype)
        if self.packed is not None:
            return self.packed(hidden)
        out = hidden @ self.weight_t
        return out if self.bias is None else out + self.bias

    def token_ids(self, columns: Tensor) -> Tensor:
        """Vocabulary ids of draft-vocabulary ``columns`` (any shape)."""
        return columns if self.tokens is None else self.tokens[columns]

    def columns(self, token_ids: Tensor, vocab_size: int) -> Tensor:
        """Draft-vocabulary column of each token id, ``-1`` where the token is outside it."""
        if self.tokens is None:
            return token_ids
        lookup = torch.full((vocab_size,), -1, dtype=torch.long, device=self.tokens.device)
        lookup[self.tokens] = torch.arange(self.size, device=self.tokens.device)
        return lookup[token_ids]


def top_proposals(logprobs: Tensor, k: int, vocab: Tensor | None) -> tuple[Tensor, Tensor]:
    """The ``k`` best columns of ``logprobs [f, N]`` as token ids: ``(tokens [f, k], logprobs [f, k])``.

    ``vocab [N]`` maps draft-vocabulary columns to ids (None: columns are ids); when ``N < k``
    the missing proposals get ``-inf`` (absent), as the session contract asks.
    """
    values, columns = logprobs.topk(min(k, logprobs.shape[1]), dim=1)
    tokens = columns if vocab is None else vocab[columns]
    if values.shape[1] < k:
        values = F.pad(values, (0, k - values.shape[1]), value=float("-inf"))
        tokens = F.pad(tokens, (0, k - tokens.shape[1]))
    return tokens, values


def full_vocabulary(probs: Tensor, vocab: Tensor | None, vocab_size: int) -> Tensor:
    """Probabilities over a draft vocabulary ``[f, N]`` -> over the target's ``[f, vocab_size]``."""
    if vocab is None and probs.shape[1] == vocab_size:
        return probs
    columns = torch.arange(probs.shape[1], device=probs.device) if vocab is None else vocab.to(probs.device)
    return probs.new_zeros(probs.shape[0], vocab_size).index_copy_(1, columns, probs)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Normal(0, std) for every linear layer, ones for norms: the usual decoder initialisation."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            nn.init.normal_(sub.weight, std=std)
        elif isinstance(sub, nn.RMSNorm):
            nn.init.ones_(sub.weight)


def register_draft_vocabulary(module: nn.Module, size: int | None) -> None:
    """Give a head its ``draft_tokens`` buffer: ``[size]`` vocabulary ids (the trainer fills
    them from response-token frequencies and they are saved with the weights), or None."""
    module.register_buffer("draft_tokens", None if size is None else torch.arange(size))
