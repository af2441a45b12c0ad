"""The EAGLE-3-style autoregressive head: one decoder layer over [token embedding ; fused feature].

An *entry* at position ``t`` pairs the fused target features ``g_t`` (a low, a middle and a
high layer) with the embedding of the next token ``x_{t+1}``: ``in_proj([norm(embed) ; g])``.
One decoder layer runs causally over the entries and the final norm's output predicts
``x_{t+2}`` through the target's frozen LM head (optionally restricted to a draft vocabulary).
Drafting deeper replaces the target's feature by the head's own output: the entry of a
drafted token ``x_{t+2}`` is ``in_proj([norm(embed(x_{t+2})) ; h_t])``.

With a single layer, an entry's keys and values are projections of its input alone, so the
context needs no attention pass: at decode time only the newly committed entries are
projected into the cache and one query row runs per step (the root's entry, depth 1), then
one batched forward per tree level (:mod:`jetflow.drafters.eagle.plugin`).

Training-time test (EAGLE-3): for each anchor ``p`` (the root token ``x_p``) the head's
depth-1 query is the context entry ``p - 1``; unrolled step ``j`` feeds the head's own step
``j - 1`` output with the true token ``x_{p+j}`` (the tokens of the path that gets accepted
are the target's) at position ``p - 1 + j``, attending to the context entries ``<= p - 1``
and its own earlier unrolled entries: exactly what a tree node at depth ``j`` sees at decode
time. Each step is one batched forward over every anchor of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from jetflow.drafters.blocks import (
    KV,
    DecoderLayer,
    FeatureFusion,
    Rotary,
    init_weights,
    register_draft_vocabulary,
)
from jetflow.drafters.examples import ExampleBatch, Predictions
from jetflow.drafters.head_sizes import HeadSizes, default_feature_layers
from pydantic import Field
from torch import Tensor, nn

if TYPE_CHECKING:
    from jetflow.drafters.blocks import FrozenTargetParts


def low_middle_high(num_layers: int) -> tuple[int, ...]:
    """First, middle and last of the block heads' feature layers (30 layers: 1, 14, 27).

    A subset of the layers the shared feature cache already holds, so training an EAGLE head
    needs no new target pass.
    """
    spread = default_feature_layers(num_layers)
    return tuple(sorted({spread[0], spread[len(spread) // 2], spread[-1]}))


class EagleHeadConfig(HeadSizes):
    """Architecture of an EAGLE head: everything needed to rebuild it from a checkpoint."""

    ttt_steps: int = Field(7, ge=1, description="unrolled training-time-test steps = supervised depths")

    @classmethod
    def default_layers(cls, num_layers: int) -> tuple[int, ...]:
        return low_middle_high(num_layers)


@dataclass(frozen=True)
class EagleCache:
    """Keys/values of the committed entries of one sequence, and the input of the last one.

    Attributes:
        kv: ``(keys, values)`` each ``[1, kv_heads, c, head_dim]``; entry ``t`` sits at position ``t``.
        last_input: ``[H]`` input of entry ``c - 1`` (the root's query), or None while empty.
    """

    kv: KV
    last_input: Tensor | None

    @property
    def length(self) -> int:
        return int(self.kv[0].shape[2])


class EagleHead(nn.Module):
    """Fusion + input projection + one decoder layer + final norm; owns no embedding or LM head."""

    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fusion = FeatureFusion(len(config.feature_layers), hidden, config.rms_norm_eps)
        self.embed_norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.in_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = DecoderLayer(config.attention_shape())
        self.norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        #: ``[N]`` vocabulary ids of the draft vocabulary (chosen by the trainer), or None
        self.draft_tokens: Tensor | None
        register_draft_vocabulary(self, config.draft_vocab_size)
        init_weights(self)

    @property
    def max_depth(self) -> int:
        """Depths supervised in training (the trainer's per-depth metrics)."""
        return self.config.ttt_steps

    @property
    def dtype(self) -> torch.dtype:
        return self.in_proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.in_proj.weight.device

    # ------------------------------------------------------------------ shared pieces
    def entry_inputs(self, embeds: Tensor, states: Tensor) -> Tensor:
        """``embeds [..., H]`` of the next tokens and ``states [..., H]`` (fused features or head outputs)."""
        return self.in_proj(torch.cat([self.embed_norm(embeds.to(self.dtype)), states], dim=-1))

    def entry_kv(self, x: Tensor, positions: Tensor) -> KV:
        """Keys/values of entries ``x [b, n, H]`` at ``positions [b, n]``: what later queries attend to."""
        return self.layer.attn.project_kv(self.layer.input_norm(x), self.rotary(positions))

    def query(self, x: Tensor, positions: Tensor, context: KV, mask: Tensor) -> Tensor:
        """``x [b, q, H]`` sees ``context`` and itself under ``mask [b, q, c + q]``: normed ``[b, q, H]``."""
        return self.norm(self.layer(x, self.rotary(positions), context, mask))

    # ------------------------------------------------------------------ training
    def forward(self, features: Tensor, embeds: Tensor, anchors: Tensor) -> Tensor:
        """Unrolled drafts from many anchors at once (training).

        ``features [b, F, k, H]`` (context of every position), ``embeds [b, T, H]`` (every token),
        ``anchors [b, N]`` (each ``>= 1``; others are computed but meaningless) -> hidden states
        ``[b, N, D, H]`` of depths ``1 .. D`` (D = ``ttt_steps``).
        """
        b, n_feat = features.shape[:2]
        n = anchors.shape[1]
        last = embeds.shape[1] - 1
        next_embeds = embeds[:, 1 : n_feat + 1]
        if next_embeds.shape[1] < n_feat:  # the last feature row has no next token: never visible
            next_embeds = torch.cat([next_embeds, embeds[:, -1:]], dim=1)
        context = self.entry_inputs(next_embeds, self.fusion(features.to(self.dtype)))  # [b, F, H]
        positions = torch.arange(n_feat, device=features.device).expand(b, -1)
        keys, values = self.entry_kv(context, positions)
        roots = (anchors - 1).clamp(min=0)  # the entry whose query gives depth 1
        x = _rows(context, roots)
        order = torch.arange(n_feat, device=features.device)
        before, through = order < roots[..., None], order <= roots[..., None]  # [b, N, F]
        own = torch.eye(n, dtype=torch.bool, device=features.device).expand(b, n, n)
        outputs = []
        for step in range(self.config.ttt_steps):
            # Step 0 is the root's own entry: context strictly before it. Step j > 0 sees the
            # context through the root's entry, the unrolled entries of steps 1 .. j - 1 of the
            # same anchor, then itself.
            mask = torch.cat([through if step else before, *[own] * max(step, 1)], dim=2)
            hidden = self.query(x, roots + step, (keys, values), mask)
            outputs.append(hidden)
            if step + 1 == self.config.ttt_steps:
                break
            if step > 0:
                keys, values = append_kv((keys, values), self.entry_kv(x, roots + step))
            x = self.entry_inputs(_rows(embeds, (anchors + step + 1).clamp(max=last)), hidden)
        return torch.stack(outputs, dim=2)

    def training_predictions(self, batch: ExampleBatch, shared: FrozenTargetParts) -> Predictions:
        """The trainer's head hook: hidden states of every supervised (anchor, depth) pair.

        An anchor at position 0 has no entry before it (nothing to condition on) and is skipped.
        """
        hidden = self(batch.features, shared.embed(batch.tokens), batch.anchors)  # [b, N, D, H]
        valid, positions = batch.depth_targets(self.max_depth)
        valid = valid & (batch.anchors >= 1)[..., None]
        rows = torch.arange(batch.size, device=valid.device)[:, None, None].expand_as(valid)
        depths = torch.arange(1, self.max_depth + 1, device=valid.device).expand_as(valid)
        return Predictions(hidden[valid], rows[valid], positions[valid], depths[valid])

    # ------------------------------------------------------------------ inference
    def empty_cache(self) -> EagleCache:
        c = self.config
        empty = torch.zeros(1, c.num_kv_heads, 0, c.head_dim, dtype=self.dtype, device=self.device)
        return EagleCache((empty, empty), None)

    def extend(self, cache: EagleCache, features: Tensor, next_embeds: Tensor) -> EagleCache:
        """Append new tokens' entries: ``features [n, k, H]`` and the next tokens' ``next_embeds [n, H]``.

        Only the new entries are projected; earlier keys/values are kept as they are.
        """
        if features.shape[0] == 0:
            return cache
        fused = self.fusion(features[None].to(self.device, self.dtype))
        x = self.entry_inputs(next_embeds[None].to(self.device), fused)
        positions = cache.length + torch.arange(x.shape[1], device=self.device)
        return EagleCache(append_kv(cache.kv, self.entry_kv(x, positions[None])), x[0, -1])

    def root_hidden(self, cache: EagleCache) -> Tensor | None:
        """The last entry's query over the cache: ``[H]``, the depth-1 state; None while empty."""
        if cache.last_input is None:
            return None
        c = cache.length
        context = (cache.kv[0][:, :, : c - 1], cache.kv[1][:, :, : c - 1])
        mask = torch.ones(1, 1, c, dtype=torch.bool, device=self.device)
        positions = torch.full((1, 1), c - 1, device=self.device)
        return self.query(cache.last_input[None, None], positions, context, mask)[0, 0]

    def draft_step(
        self, cache: EagleCache, drafted: KV, x: Tensor, positions: Tensor, mask: Tensor
    ) -> Tensor:
        """One tree level: ``x [q, H]`` at ``positions [q]`` -> ``[q, H]``.

        Each query sees the whole cache, the drafted entries ``drafted`` (``[1, kv, m, d]``)
        that ``mask [q, m + q]`` allows (its ancestors) and itself.
        """
        context = append_kv(cache.kv, drafted)
        full = torch.cat([mask.new_ones(mask.shape[0], cache.length), mask], dim=1)
        return self.query(x[None], positions[None], context, full[None])[0]


def append_kv(kv: KV, new: KV) -> KV:
    """Keys and values ``[b, kv_heads, n, d]`` followed by ``new`` along the sequence."""
    return torch.cat([kv[0], new[0]], dim=2), torch.cat([kv[1], new[1]], dim=2)


def _rows(x: Tensor, index: Tensor) -> Tensor:
    """``x [b, T, H]`` at ``index [b, N]`` -> ``[b, N, H]``."""
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))
