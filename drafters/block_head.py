"""The block head shared by JetFlow (causal in-block mask) and DFlash (bidirectional).

One forward drafts a whole block: slot 0 holds the embedding of the anchor (the root:
the last committed token, not yet processed by the target), slots ``1 .. B-1`` a learned
mask-token embedding; slot ``d`` sits at absolute position ``p + d`` and predicts the token
there, i.e. depth ``d`` of the draft. Every layer attends to the context (the fused target
features of tokens ``0 .. p-1``, projected by that layer's own k/v projections) and to the
block under the in-block mask. ``causal`` is the only difference between the two heads.

Visibility is defined once, in :meth:`BlockHead.block_mask`, and used by both paths:

* inference (:meth:`BlockHead.extend` / :meth:`BlockHead.draft_rows`): the context keys/values
  are cached per layer and sequence and grow by the newly processed tokens each step; one
  forward drafts the blocks of several sequences (their contexts padded to the longest);
* training (:meth:`BlockHead.forward`): many anchors per sequence in one batch; a query of
  the block at anchor ``p`` sees context positions ``< p`` and its own block only.

The generic :meth:`BlockHead.block_hidden` takes any block embeddings, positions and mask,
which is what a path-conditioned refresh pass (actual tree tokens under the tree's ancestor
mask) would call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from jetflow.drafters.blocks import (
    KV,
    DecoderLayer,
    FeatureFusion,
    Rotary,
    init_weights,
    register_draft_vocabulary,
)
from jetflow.drafters.draft_head import DraftHead
from jetflow.drafters.examples import ExampleBatch, Predictions
from jetflow.drafters.head_sizes import HeadSizes
from pydantic import Field, model_validator
from torch import Tensor, nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from jetflow.core.target import Target
    from jetflow.drafters.blocks import FrozenTargetParts


class BlockHeadConfig(HeadSizes):
    """Architecture of a block head: everything needed to rebuild it from a checkpoint."""

    num_layers: int = Field(2, ge=1, description="head decoder layers")
    block_size: int = Field(16, ge=2, description="anchor + mask slots; max draft depth is block_size - 1")
    causal: bool = Field(True, description="in-block mask: causal (JetFlow) or bidirectional (DFlash)")
    anchored_slots: bool = Field(
        False,
        description="add a projection of [anchor embedding ; last context feature] to every mask slot "
        "(with one learned embedding per depth) instead of leaving all conditioning to attention",
    )
    path_conditioning: float = Field(
        0.0,
        ge=0,
        le=1,
        description="share of training blocks whose first slots hold the true tokens; > 0 trains the "
        "head for the path-conditioned refresh (causal heads only)",
    )
    context_tokens: bool = Field(
        False,
        description="every context entry also holds the embedding of the token written after it "
        "(EAGLE's input), so the context carries what followed each feature",
    )
    init_from_target: bool = Field(
        False,
        description="a new head starts from the target's own top num_layers decoder layers and final "
        "norm (recorded; a checkpoint's weights are loaded as saved)",
    )

    @model_validator(mode="after")
    def _conditioning_needs_causal(self) -> BlockHeadConfig:
        if self.path_conditioning and not self.causal:
            raise ValueError("path_conditioning needs a causal in-block mask")
        return self

    @property
    def max_depth(self) -> int:
        return self.block_size - 1


@dataclass(frozen=True)
class ContextCache:
    """Per-layer keys/values of the context processed so far (one sequence).

    Attributes:
        kv: one ``(keys, values)`` per head layer, each ``[1, kv_heads, c, head_dim]``.
    """

    kv: tuple[KV, ...]
    #: ``[H]`` fused feature of the last context token (zeros before any), for anchored slots
    last_fused: Tensor | None = None

    @property
    def length(self) -> int:
        return self.kv[0][0].shape[2]  # a plain int, symbolic while the step is exported


class BlockHead(DraftHead[ContextCache]):
    """Fusion + decoder layers + final norm + mask embedding; owns no embedding or LM head.

    With ``draft_vocab_size`` it also keeps the ids of its draft vocabulary (a small integer
    buffer saved with the weights): the rows of the target's LM head it drafts over.
    """

    config: BlockHeadConfig

    def __init__(self, config: BlockHeadConfig) -> None:
        super().__init__()
        self.config = config
        shape = config.attention_shape()
        self.fusion = FeatureFusion(len(config.feature_layers), config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        slots = (config.block_size - 1,) if config.anchored_slots else ()
        self.mask_embedding = nn.Parameter(torch.zeros(*slots, config.hidden_size))
        hidden, anchored = config.hidden_size, config.anchored_slots
        self.slot_proj = nn.Linear(2 * hidden, hidden, bias=False) if anchored else None
        # Token embeddings are ~10x smaller than the normed fused features: normalise them first.
        self.anchor_norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps) if anchored else None
        tokens = config.context_tokens
        self.token_norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps) if tokens else None
        self.token_proj = nn.Linear(hidden, hidden, bias=False) if tokens else None
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        #: ``[N]`` vocabulary ids of the draft vocabulary (chosen by the trainer), or None
        self.draft_tokens: Tensor | None
        register_draft_vocabulary(self, config.draft_vocab_size)
        init_weights(self)
        nn.init.normal_(self.mask_embedding, std=0.02)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder layers, typed (a ``ModuleList`` yields plain modules to a type checker)."""
        return cast("list[DecoderLayer]", list(self.layers))

    @property
    def max_depth(self) -> int:
        return self.config.max_depth

    @property
    def dtype(self) -> torch.dtype:
        return self.mask_embedding.dtype

    @property
    def device(self) -> torch.device:
        return self.mask_embedding.device

    # ------------------------------------------------------------------ shared pieces
    def in_block_mask(self) -> Tensor:
        """``[B, B]`` bool: lower-triangular when causal, all true when bidirectional."""
        size = self.config.block_size
        full = torch.ones(size, size, dtype=torch.bool, device=self.device)
        return full.tril() if self.config.causal else full

    def block_mask(self, anchors: Tensor, context_length: int) -> Tensor:
        """Visibility of ``N`` blocks over ``[context ; blocks]``: ``[b, N*B, context_length + N*B]``.

        A slot of the block at anchor ``p`` sees context positions ``< p`` (the tokens the
        target has processed; the anchor's own features do not exist yet at decode time)
        and, within its own block only, the slots the in-block mask allows.
        """
        b, n = anchors.shape
        size = self.config.block_size
        ctx = torch.arange(context_length, device=anchors.device) < anchors[..., None]  # [b, N, c]
        ctx = ctx[:, :, None, :].expand(b, n, size, context_length).reshape(b, n * size, context_length)
        same = torch.eye(n, dtype=torch.bool, device=anchors.device)
        blocks = same[:, None, :, None] & self.in_block_mask().to(anchors.device)[None, :, None, :]
        blocks = blocks.reshape(n * size, n * size).expand(b, -1, -1)
        return torch.cat([ctx, blocks], dim=2)

    def block_inputs(
        self,
        anchor_embeds: Tensor,
        revealed: tuple[Tensor, Tensor] | None = None,
        last_fused: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Block embeddings ``[b, N*B, H]`` and their offsets from the anchor ``[N*B]``.

        ``anchor_embeds [b, N, H]``: slot 0 is the anchor, the rest the mask token, except
        that with ``revealed = (embeds [b, N, B-1, H], counts [b, N])`` slots ``1 .. count``
        hold the embeddings of the true tokens there (path-conditioning training). With
        ``anchored_slots``, ``last_fused [b, N, H]`` is the fused feature before each anchor.
        """
        b, n, hidden = anchor_embeds.shape
        size = self.config.block_size
        masks = self.mask_slots(anchor_embeds, last_fused).expand(b, n, size - 1, hidden)
        if revealed is not None:
            embeds, counts = revealed
            shown = torch.arange(1, size, device=counts.device) <= counts[..., None]  # [b, N, B-1]
            masks = torch.where(shown[..., None], embeds.to(self.dtype), masks)
        block = torch.cat([anchor_embeds.to(self.dtype)[:, :, None], masks], dim=2)
        offsets = torch.arange(size, device=anchor_embeds.device).repeat(n)
        return block.reshape(b, n * size, hidden), offsets

    def mask_slots(self, anchor_embeds: Tensor, last_fused: Tensor | None) -> Tensor:
        """Inputs of the mask slots: ``[b, N, 1 or B-1, H]``.

        Plain: the one mask token. Anchored: a learned embedding per depth plus a projection
        of ``[anchor embedding ; fused feature of the token before the anchor]``, so every
        slot starts from what an EAGLE query sees instead of fetching it through attention.
        """
        if self.slot_proj is None or self.anchor_norm is None:
            return self.mask_embedding.expand(*anchor_embeds.shape[:2], 1, -1)
        if last_fused is None:
            raise ValueError("anchored slots need the fused feature before each anchor")
        anchor = self.anchor_norm(anchor_embeds.to(self.dtype))
        summary = self.slot_proj(torch.cat([anchor, last_fused.to(self.dtype)], dim=-1))
        return self.mask_embedding + summary[:, :, None]

    def fused_before(self, fused: Tensor, anchors: Tensor) -> Tensor | None:
        """``[b, N, H]`` fused feature of the token before each anchor (zeros at anchor 0)."""
        if self.slot_proj is None:
            return None
        before = fused.gather(1, (anchors - 1).clamp(min=0)[..., None].expand(-1, -1, fused.shape[-1]))
        return before * (anchors > 0)[..., None]

    def context_entries(self, features: Tensor, next_embeds: Tensor | None = None) -> Tensor:
        """Context entries ``[b, c, H]`` of ``features [b, c, k, H]``: their fusion and, with
        ``context_tokens``, a projection of the embedding of the token after each one
        (``next_embeds [b, c, H]``; the last context token's next token is the anchor)."""
        fused = self.fusion(features.to(self.dtype))
        if self.token_proj is None or self.token_norm is None:
            return fused
        if next_embeds is None:
            raise ValueError("a head with context_tokens needs the embeddings of the next tokens")
        return fused + self.token_proj(self.token_norm(next_embeds.to(self.dtype)))

    def context_kv(
        self, features: Tensor, start: int = 0, next_embeds: Tensor | None = None
    ) -> tuple[KV, ...]:
        """Per-layer keys/values of ``features [b, c, k, H]`` at positions ``start ..``."""
        return self.context_kv_of(self.context_entries(features, next_embeds), start)

    def context_kv_of(self, fused: Tensor, start: int = 0) -> tuple[KV, ...]:
        """Per-layer keys/values of already ``fused [b, c, H]`` features at positions ``start ..``."""
        positions = start + torch.arange(fused.shape[1], device=fused.device)
        rotary = self.rotary(positions.expand(fused.shape[0], -1))
        return tuple(layer.context_kv(fused, rotary) for layer in self.decoder_layers)

    def block_hidden(self, x: Tensor, positions: Tensor, context: tuple[KV, ...], mask: Tensor) -> Tensor:
        """The generic block forward: ``x [b, q, H]`` at ``positions [b, q]`` -> normed ``[b, q, H]``.

        ``mask [b, q, c + q]`` covers the ``c`` context entries of ``context`` and the block.
        """
        rotary = self.rotary(positions)
        for layer, kv in zip(self.decoder_layers, context, strict=True):
            x = layer(x, rotary, kv, mask)
        return self.norm(x)

    # ------------------------------------------------------------------ training
    def forward(
        self,
        features: Tensor,
        anchor_embeds: Tensor,
        anchors: Tensor,
        revealed: tuple[Tensor, Tensor] | None = None,
        next_embeds: Tensor | None = None,
    ) -> Tensor:
        """Many blocks per sequence at once (training).

        ``features [b, T, k, H]`` (context of every position), ``anchor_embeds [b, N, H]``,
        ``anchors [b, N]``, optional ``revealed`` (see :meth:`block_inputs`) and, for
        ``context_tokens``, ``next_embeds [b, T, H]`` (embedding of the token after each
        position) -> per-depth hidden states ``[b, N, D, H]`` (D = block_size - 1).
        """
        b, n = anchors.shape
        size = self.config.block_size
        fused = self.context_entries(features, next_embeds)
        context = self.context_kv_of(fused)
        x, offsets = self.block_inputs(anchor_embeds, revealed, self.fused_before(fused, anchors))
        positions = anchors.repeat_interleave(size, dim=1) + offsets
        hidden = self.block_hidden(x, positions, context, self.block_mask(anchors, features.shape[1]))
        return hidden.view(b, n, size, -1)[:, :, 1:]

    def training_predictions(self, batch: ExampleBatch, shared: FrozenTargetParts) -> Predictions:
        """The trainer's head hook: hidden states of every supervised (anchor, depth) pair."""
        anchor_embeds = shared.embed(batch.tokens.gather(1, batch.anchors))
        valid, positions = batch.depth_targets(self.max_depth)
        revealed = None
        if self.training and self.config.path_conditioning > 0:
            counts = self.reveal_counts(batch.anchors, batch.anchor_valid)
            depth_tokens = batch.tokens.gather(1, positions.flatten(1).clamp(max=batch.tokens.shape[1] - 1))
            revealed = (shared.embed(depth_tokens).view(*positions.shape, -1), counts)
            # A revealed slot sees its own token: it teaches nothing.
            valid = valid & (torch.arange(1, self.max_depth + 1, device=valid.device) > counts[..., None])
        next_embeds = None
        if self.token_proj is not None:  # token t + 1 for each context position t (zero past the end)
            following = F.pad(batch.tokens[:, 1:], (0, 1))[:, : batch.features.shape[1]]
            next_embeds = shared.embed(following)
        hidden = self(batch.features, anchor_embeds, batch.anchors, revealed, next_embeds)  # [b, N, D, H]
        rows = torch.arange(batch.size, device=valid.device)[:, None, None].expand_as(valid)
        depths = torch.arange(1, self.max_depth + 1, device=valid.device).expand_as(valid)
        return Predictions(hidden[valid], rows[valid], positions[valid], depths[valid])

    def reveal_counts(self, anchors: Tensor, valid: Tensor | None = None) -> Tensor:
        """``[b, N]`` true tokens shown per training block: 0, or uniform in ``1 .. B-2`` for a
        ``path_conditioning`` share of the blocks (``valid [b, N]``: the real anchors).

        Drawn per sequence from a generator seeded by its own anchors, so a resumed run draws
        the same, and so does a data-parallel process that holds the sequence in another batch.
        """
        valid = torch.ones_like(anchors, dtype=torch.bool) if valid is None else valid.to(anchors.device)
        counts = torch.zeros(anchors.shape, dtype=torch.long)
        for row in range(anchors.shape[0]):  # a few sequences per batch, not a loop over tokens
            mine = anchors[row][valid[row]].cpu()
            generator = torch.Generator().manual_seed(int(mine.sum()) * 7919 + mine.numel())
            shown = torch.rand(mine.shape, generator=generator) < self.config.path_conditioning
            drawn = torch.randint(1, self.config.block_size - 1, mine.shape, generator=generator)
            counts[row, valid[row].cpu()] = torch.where(shown, drawn, 0)
        return counts.to(anchors.device)

    # ------------------------------------------------------------------ inference
    def empty_cache(self) -> ContextCache:
        c = self.config
        empty = torch.zeros(1, c.num_kv_heads, 0, c.head_dim, dtype=self.dtype, device=self.device)
        last = torch.zeros(c.hidden_size, dtype=self.dtype, device=self.device)
        return ContextCache(tuple((empty, empty) for _ in self.layers), last)

    def extend(
        self, cache: ContextCache, features: Tensor, next_embeds: Tensor | None = None
    ) -> ContextCache:
        """Append newly processed tokens' ``features [n, k, H]``: only they are projected.

        With ``context_tokens``, ``next_embeds [n, H]`` embeds the token after each of them.
        """
        return self.extend_rows([cache], [features], [next_embeds])[0]

    def extend_rows(
        self,
        caches: Sequence[ContextCache],
        features: Sequence[Tensor],
        next_embeds: Sequence[Tensor | None],
    ) -> list[ContextCache]:
        """:meth:`extend` of several sequences' caches, their new tokens projected in one pass.

        Every row's few new tokens go through the fusion and each layer's key-value projection
        together, so the head's weights are read once per step rather than once per row.
        """
        counts = [rows.shape[0] for rows in features]
        if not any(counts):
            return list(caches)
        joined = torch.cat([rows.to(device=self.device, dtype=self.dtype) for rows in features])[None]
        following = None
        if self.token_proj is not None:
            given = [embeds for embeds, n in zip(next_embeds, counts, strict=True) if n]
            if any(embeds is None for embeds in given):
                raise ValueError("a head with context_tokens needs the embeddings of the next tokens")
            following = torch.cat(cast("list[Tensor]", given))[None]
        fused = self.context_entries(joined, following)  # [1, S, H]
        positions = torch.cat(
            [
                cache.length + torch.arange(n, device=self.device)
                for cache, n in zip(caches, counts, strict=True)
            ]
        )
        rotary = self.rotary(positions[None])
        new = [layer.context_kv(fused, rotary) for layer in self.decoder_layers]  # [1, kv, S, d] each
        extended, start = [], 0
        for cache, n in zip(caches, counts, strict=True):
            if n == 0:
                extended.append(cache)
                continue
            end = start + n
            kv = tuple(
                (torch.cat([k, nk[:, :, start:end]], dim=2), torch.cat([v, nv[:, :, start:end]], dim=2))
                for (k, v), (nk, nv) in zip(cache.kv, new, strict=True)
            )
            extended.append(ContextCache(kv, fused[0, end - 1]))
            start = end
        return extended

    def draft(self, cache: ContextCache, anchor_embed: Tensor) -> Tensor:
        """One decoding step: ``anchor_embed [H]`` at position ``cache.length`` -> ``[D, H]``."""
        return self.draft_rows([cache], anchor_embed[None])[0]

    def draft_rows(
        self, caches: Sequence[ContextCache], anchor_embeds: Tensor, depth: int | None = None
    ) -> Tensor:
        """One decoding step of ``R`` sequences in one forward: ``anchor_embeds [R, H]`` -> ``[R, D, H]``.

        Row ``r``'s anchor sits at position ``caches[r].length``. The contexts are right-padded
        to the longest; the block mask hides each row's padding, so a row's drafts are those
        of the row alone. ``depth`` bounds the depths needed: a causal head's slot sees only
        the slots before it, so its first ``depth`` slots alone give exactly the same drafts
        (``D = depth``) for a fraction of the work when the trees are small.
        """
        lengths = torch.tensor([cache.length for cache in caches], device=self.device)
        context = _padded_kv(caches)
        x, offsets = self.block_inputs(anchor_embeds[:, None], last_fused=self._last_rows(caches))
        c = context[0][0].shape[2]
        mask = self.block_mask(lengths[:, None], c)
        keep = 1 + self.drafted_depths(depth)
        x, offsets, mask = x[:, :keep], offsets[:keep], mask[:, :keep, : c + keep]
        return self.block_hidden(x, lengths[:, None] + offsets, context, mask)[:, 1:]

    def drafted_depths(self, depth: int | None) -> int:
        """``D``, the depths :meth:`draft_rows` computes for trees no deeper than ``depth`` (None:
        unbounded): every slot of the block unless it is causal, where the first ``depth`` suffice."""
        deepest = self.config.block_size - 1
        if depth is None or not self.config.causal:  # a bidirectional block's slots all see each other
            return deepest
        return max(1, min(depth, deepest))

    def _last_rows(self, caches: Sequence[ContextCache]) -> Tensor | None:
        """The caches' last fused features as ``[R, 1, H]`` when the slots need them."""
        lasts = [cache.last_fused for cache in caches]
        if self.slot_proj is None or any(last is None for last in lasts):
            return None
        return torch.stack(cast("list[Tensor]", lasts))[:, None]

    def refresh(self, cache: ContextCache, node_embeds: Tensor, depths: Tensor, ancestors: Tensor) -> Tensor:
        """Path-conditioned children of every node of a draft tree in one pass: ``[n, H]``.

        ``node_embeds [n, H]`` (the root's is the anchor's), ``depths [n]`` and
        ``ancestors [n, n]`` (``DraftTree.ancestor_mask``). Each node is a slot holding its
        actual token at position ``p + depth`` that sees its ancestors; each node also gets
        a mask query at ``p + depth + 1`` that sees the node's path and itself - exactly a
        training block whose first ``depth`` slots are revealed - so the query's output is
        the distribution of that node's children given its own path.
        """
        n = node_embeds.shape[0]
        length = cache.length
        root = node_embeds[:1].reshape(1, 1, -1)
        slots = self.mask_slots(root, self._last_rows([cache]))[0, 0]  # [1 or D, H]
        queries = slots[depths.clamp(max=slots.shape[0] - 1).to(self.device)]  # depth d asks slot d + 1
        x = torch.cat([node_embeds.to(self.dtype), queries])[None]
        positions = length + torch.cat([depths, depths + 1]).to(self.device)[None]
        ancestors = ancestors.to(self.device)
        own = torch.eye(n, dtype=torch.bool, device=self.device)
        tree = torch.cat(
            [torch.cat([ancestors, torch.zeros_like(ancestors)], 1), torch.cat([ancestors, own], 1)]
        )
        context = torch.ones(2 * n, length, dtype=torch.bool, device=self.device)
        mask = torch.cat([context, tree], dim=1)[None]
        return self.block_hidden(x, positions, cache.kv, mask)[0, n:]


def _padded_kv(caches: Sequence[ContextCache]) -> tuple[KV, ...]:
    """Per-layer keys/values of several caches as one batch ``[R, kv_heads, c_max, d]``.

    Each is zero-padded at its end to the longest (the block mask hides the padding); a
    single cache is passed through without a copy.
    """
    if len(caches) == 1:
        return caches[0].kv
    longest = max(cache.length for cache in caches)

    def stacked(layer: int, part: int) -> Tensor:
        pieces = [cache.kv[layer][part] for cache in caches]
        return torch.cat([F.pad(t, (0, 0, 0, longest - t.shape[2])) for t in pieces])

    return tuple((stacked(i, 0), stacked(i, 1)) for i in range(len(caches[0].kv)))


#: head parameter -> the same tensor's name in a transformers decoder layer (Llama, Qwen3)
_TARGET_LAYER_NAMES = {
    "input_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "post_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}


def target_has_qk_norm(target: Target) -> bool:
    """Whether the target's attention normalises queries and keys (Qwen3 does, Llama does not)."""
    return "self_attn.q_norm.weight" in target.model.get_decoder().layers[-1].state_dict()


@torch.no_grad()
def copy_target_layers(head: BlockHead, target: Target) -> None:
    """Start ``head``'s decoder layers from the target's top ones (and its norm from the final norm).

    With little data the target's own weights are the strongest prior there is; the fusion,
    mask embedding and slot projections stay freshly initialised. Raises ``ValueError`` when
    a layer has no counterpart of the same shape (e.g. a mixture-of-experts MLP).
    """
    decoder = target.model.get_decoder()
    sources = decoder.layers[len(decoder.layers) - len(head.layers) :]
    if len(sources) < len(head.layers):
        raise ValueError(f"the target has {len(decoder.layers)} layers, the head {len(head.layers)}")
    for layer, source in zip(head.layers, sources, strict=True):
        theirs = source.state_dict()
        for name, tensor in layer.state_dict().items():
            match = theirs.get(_TARGET_LAYER_NAMES.get(name, ""))
            if match is None or match.shape != tensor.shape:
                raise ValueError(f"the target's layers have no {name} of shape {tuple(tensor.shape)}")
            tensor.copy_(match)
    head.norm.weight.copy_(decoder.norm.weight)
