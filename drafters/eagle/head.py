"""The EAGLE-3-style autoregressive head: one decoder layer over [token embedding ; state].

An *entry* at position ``t`` pairs a state with the embedding of the next token ``x_{t+1}``;
in the context the state is the fused target features ``g_t`` (a low, a middle and a high
layer). One decoder layer runs causally over the entries and the final norm's output
predicts ``x_{t+2}`` through the target's frozen LM head (optionally restricted to a draft
vocabulary). Drafting deeper replaces the target's feature by the head's own state: the
entry of a drafted token ``x_{t+2}`` pairs ``embed(x_{t+2})`` with the state of ``t``.

Two layouts differ only in how an entry enters the layer and which output is the next
state (``EagleHeadConfig.layout``); everything else is one code path:

* ``jetflow`` (the shipped heads): ``x = in_proj([norm(embed) ; state])`` (2H -> H), the
  layer's input norm before q/k/v, residual ``x``; the context state is the fused feature
  ``norm(proj(g))``; the next state is the normed output itself.
* ``eagle3`` (vLLM's Eagle3 draft layer, exportable): q/k/v read ``[norm(embed) ;
  hidden_norm(state)]`` (2H) directly, the residual is ``hidden_norm(state)``
  (``norm_before_residual``); the context state is ``fc(g)`` alone; the next state is the
  layer's output before the final norm (not ``norm_output``). :data:`EAGLE3_OPTIONS` names
  these choices as vLLM's config does.

An entry is kept as one tensor ``[..., W + H]``: what attention reads (``W`` = H or 2H)
followed by the residual it adds to, so gathering, caching and batching entries is the
same for both layouts.

With a single layer, an entry's keys and values are projections of its input alone, so the
context needs no attention pass: at decode time only the newly committed entries are
projected into the cache and one query row runs per step (the root's entry, depth 1), then
one batched forward per tree level (:mod:`jetflow.drafters.eagle.plugin`).

Training-time test (EAGLE-3): for each anchor ``p`` (the root token ``x_p``) the head's
depth-1 query is the context entry ``p - 1``; unrolled step ``j`` feeds the head's own step
``j - 1`` state with the true token ``x_{p+j}`` (the tokens of the path that gets accepted
are the target's) at position ``p - 1 + j``, attending to the context entries ``<= p - 1``
and its own earlier unrolled entries: exactly what a tree node at depth ``j`` sees at decode
time. Each step is one batched forward over every anchor of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Self

import torch
from jetflow.drafters.blocks import (
    KV,
    ContextAttention,
    FeatureFusion,
    Rotary,
    SwiGLU,
    init_weights,
    register_draft_vocabulary,
)
from jetflow.drafters.draft_head import DraftHead
from jetflow.drafters.examples import ExampleBatch, Predictions
from jetflow.drafters.head_sizes import HeadSizes, default_feature_layers
from pydantic import Field
from torch import Tensor, nn

if TYPE_CHECKING:
    from jetflow.core.target import Target
    from jetflow.drafters.blocks import FrozenTargetParts

Layout = Literal["jetflow", "eagle3"]

#: vLLM's Eagle3 options, as its speculators config names them, that the ``eagle3`` layout
#: computes: the residual starts from ``hidden_norm(state)`` (so a context entry's residual is
#: ``hidden_norm(fc(g))``, the normed fused feature, as in the jetflow layout, and every
#: unrolled step restarts from a normed stream), the next state is the pre-norm output,
#: and ``fc`` reads the raw target states (no norm before it, none per layer).
EAGLE3_OPTIONS: dict[str, bool] = {
    "norm_before_residual": True,
    "norm_output": False,
    "norm_before_fc": False,
    "fc_norm": False,
}


def low_middle_high(num_layers: int) -> tuple[int, ...]:
    """First, middle and last of the block heads' feature layers (30 layers: 1, 14, 27).

    A subset of the layers the shared feature cache already holds, so training an EAGLE head
    needs no new target pass.
    """
    spread = default_feature_layers(num_layers)
    return tuple(sorted({spread[0], spread[len(spread) // 2], spread[-1]}))


def norms_queries_and_keys(target: Target) -> bool:
    """Whether the target's attention RMS-norms q and k per head (Qwen3) or not (Llama)."""
    return any(name.endswith(".q_norm") for name, _ in target.model.named_modules())


class EagleHeadConfig(HeadSizes):
    """Architecture of an EAGLE head: everything needed to rebuild it from a checkpoint."""

    ttt_steps: int = Field(7, ge=1, description="unrolled training-time-test steps = supervised depths")
    layout: Layout = Field(
        "jetflow",
        description="jetflow: [norm(embed) ; state] projected to H before the layer (the shipped heads); "
        "eagle3: vLLM's Eagle3 layer (q/k/v read the 2H concatenation), exportable to vLLM",
    )

    @classmethod
    def default_layers(cls, num_layers: int) -> tuple[int, ...]:
        return low_middle_high(num_layers)

    @classmethod
    def for_target(cls, target: Target, **overrides: object) -> Self:
        """As :meth:`HeadSizes.for_target`; an ``eagle3`` head's layer is the target family's
        (q/k norms for a Qwen3 target, none for a Llama), as vLLM's Eagle3 classes are."""
        if overrides.get("layout") == "eagle3" and "qk_norm" not in overrides:
            overrides = {"qk_norm": norms_queries_and_keys(target)} | overrides
        return super().for_target(target, **overrides)


@dataclass(frozen=True)
class EagleCache:
    """Keys/values of the committed entries of one sequence, and the last entry.

    Attributes:
        kv: ``(keys, values)`` each ``[1, kv_heads, c, head_dim]``; entry ``t`` sits at position ``t``.
        last_input: ``[W + H]`` entry ``c - 1`` (the root's query), or None while empty.
    """

    kv: KV
    last_input: Tensor | None

    @property
    def length(self) -> int:
        return int(self.kv[0].shape[2])


class EagleLayer(nn.Module):
    """The head's decoder layer: attention over entries, added to the entry's residual, then an MLP.

    The layouts differ in the norm that prepares an entry (``input_norm`` of the projected
    entry, or ``hidden_norm`` of the state) and in how wide q/k/v's input is.
    """

    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        if config.layout == "jetflow":
            self.input_norm = nn.RMSNorm(hidden, eps=eps)
        else:
            self.hidden_norm = nn.RMSNorm(hidden, eps=eps)
        self.attn = ContextAttention(config.attention_shape())
        if config.layout == "eagle3":  # q/k/v read [norm(embed) ; hidden_norm(state)] directly
            for name in ("q_proj", "k_proj", "v_proj"):
                rows = getattr(self.attn, name).out_features
                setattr(self.attn, name, nn.Linear(2 * hidden, rows, bias=False))
        self.post_norm = nn.RMSNorm(hidden, eps=eps)
        self.mlp = SwiGLU(hidden, config.intermediate_size)

    def forward(
        self, attn_input: Tensor, residual: Tensor, rotary: tuple[Tensor, Tensor], context: KV, mask: Tensor
    ) -> Tensor:
        """``attn_input [b, q, W]`` sees ``context`` and itself under ``mask``: ``[b, q, H]``, pre-norm."""
        x = residual + self.attn(attn_input, rotary, context, mask)
        return x + self.mlp(self.post_norm(x))


class EagleHead(DraftHead[EagleCache]):
    """Fusion + entry + one decoder layer + final norm; owns no embedding or LM head."""

    config: EagleHeadConfig

    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fusion = FeatureFusion(len(config.feature_layers), hidden, config.rms_norm_eps)
        if config.layout == "eagle3":  # vLLM's fc alone: hidden_norm normalises every state
            self.fusion.norm = nn.Identity()
        self.embed_norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.in_proj = nn.Linear(2 * hidden, hidden, bias=False) if config.layout == "jetflow" else None
        self.layer = EagleLayer(config)
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
        return self.fusion.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fusion.proj.weight.device

    # ------------------------------------------------------------------ shared pieces
    def entry_inputs(self, embeds: Tensor, states: Tensor) -> Tensor:
        """``embeds [..., H]`` of the next tokens and ``states [..., H]`` -> entries ``[..., W + H]``.

        The states are fused features (the context) or the head's own states (drafted tokens).
        """
        embeds = self.embed_norm(embeds.to(self.dtype))
        if self.in_proj is not None:  # jetflow
            x = self.in_proj(torch.cat([embeds, states], dim=-1))
            return torch.cat([self.layer.input_norm(x), x], dim=-1)
        normed = self.layer.hidden_norm(states)  # eagle3: norm_before_residual
        return torch.cat([embeds, normed, normed], dim=-1)

    def _split(self, entries: Tensor) -> tuple[Tensor, Tensor]:
        """Entries ``[..., W + H]`` -> (attention's input ``[..., W]``, residual ``[..., H]``)."""
        hidden = self.config.hidden_size
        return entries[..., :-hidden], entries[..., -hidden:]

    def entry_kv(self, entries: Tensor, positions: Tensor) -> KV:
        """Keys/values of ``entries [b, n, W + H]`` at ``positions [b, n]``: what later queries attend to."""
        return self.layer.attn.project_kv(self._split(entries)[0], self.rotary(positions))

    def query(self, entries: Tensor, positions: Tensor, context: KV, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``entries [b, q, W + H]`` see ``context`` and themselves under ``mask [b, q, c + q]``.

        Returns ``(normed, state)``, each ``[b, q, H]``: the final norm's output (the logits'
        input) and the state a drafted child's entry pairs with its token.
        """
        out = self.layer(*self._split(entries), self.rotary(positions), context, mask)
        normed = self.norm(out)
        return normed, (normed if self.config.layout == "jetflow" else out)

    # ------------------------------------------------------------------ training
    def forward(self, features: Tensor, embeds: Tensor, anchors: Tensor) -> Tensor:
        """Unrolled drafts from many anchors at once (training).

        ``features [b, F, k, H]`` (context of every position), ``embeds [b, T, H]`` (every token),
        ``anchors [b, N]`` (each ``>= 1``; others are computed but meaningless) -> normed hidden
        states ``[b, N, D, H]`` of depths ``1 .. D`` (D = ``ttt_steps``).
        """
        b, n_feat = features.shape[:2]
        n = anchors.shape[1]
        last = embeds.shape[1] - 1
        next_embeds = embeds[:, 1 : n_feat + 1]
        if next_embeds.shape[1] < n_feat:  # the last feature row has no next token: never visible
            next_embeds = torch.cat([next_embeds, embeds[:, -1:]], dim=1)
        context = self.entry_inputs(next_embeds, self.fusion(features.to(self.dtype)))  # [b, F, W + H]
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
            hidden, state = self.query(x, roots + step, (keys, values), mask)
            outputs.append(hidden)
            if step + 1 == self.config.ttt_steps:
                break
            if step > 0:
                keys, values = append_kv((keys, values), self.entry_kv(x, roots + step))
            x = self.entry_inputs(_rows(embeds, (anchors + step + 1).clamp(max=last)), state)
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

    def root_hidden(self, cache: EagleCache) -> tuple[Tensor, Tensor] | None:
        """The last entry's query over the cache: ``(normed, state)`` ``[H]`` of depth 1; None while empty."""
        if cache.last_input is None:
            return None
        c = cache.length
        context = (cache.kv[0][:, :, : c - 1], cache.kv[1][:, :, : c - 1])
        mask = torch.ones(1, 1, c, dtype=torch.bool, device=self.device)
        positions = torch.full((1, 1), c - 1, device=self.device)
        normed, state = self.query(cache.last_input[None, None], positions, context, mask)
        return normed[0, 0], state[0, 0]

    def draft_step(
        self, cache: EagleCache, drafted: KV, x: Tensor, positions: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """One tree level: entries ``x [q, W + H]`` at ``positions [q]`` -> ``(normed, state)`` ``[q, H]``.

        Each query sees the whole cache, the drafted entries ``drafted`` (``[1, kv, m, d]``)
        that ``mask [q, m + q]`` allows (its ancestors) and itself.
        """
        context = append_kv(cache.kv, drafted)
        full = torch.cat([mask.new_ones(mask.shape[0], cache.length), mask], dim=1)
        normed, state = self.query(x[None], positions[None], context, full[None])
        return normed[0], state[0]


def append_kv(kv: KV, new: KV) -> KV:
    """Keys and values ``[b, kv_heads, n, d]`` followed by ``new`` along the sequence."""
    return torch.cat([kv[0], new[0]], dim=2), torch.cat([kv[1], new[1]], dim=2)


def _rows(x: Tensor, index: Tensor) -> Tensor:
    """``x [b, T, W]`` at ``index [b, N]`` -> ``[b, N, W]``."""
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))
