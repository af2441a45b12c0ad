"""Batched greedy decoding that captures the target's states on the way.

On a CPU the loop is bound by memory traffic as much as by arithmetic, hence: prompts
prefilled in groups of similar length, one KV slab written in place
(:mod:`jetflow.core.kv_cache`), finished rows and padding no row needs dropped as they appear.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from jetflow.core.kv_cache import SlabLayer, slab_cache, slab_layers
from jetflow.drafters.training.feature_cache import FEATURE_DTYPE
from jetflow.drafters.training.features import batches_by_length, decoder_states
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer


@dataclass
class Generation:
    """One greedy answer: ``response [R]`` (ends with EOS when the target stopped) and,
    when captured, the states of prompt + response but its last token:
    ``features [P+R-1, k, H]`` and ``final [P+R-1, H]`` (fp16)."""

    response: Tensor
    features: Tensor | None = None
    final: Tensor | None = None

    def captured(self) -> tuple[Tensor, Tensor]:
        """``(features, final)``, which a generation with layers to capture has."""
        if self.features is None or self.final is None:
            raise RuntimeError("the generation captured no states (no feature layers asked for)")
        return self.features, self.final


@dataclass
class _Prefill:
    """What the prompts leave behind: the first answer token ``[B]`` and, when captured,
    the states of each prompt (``[P_i, k, H]`` and ``[P_i, H]``, fp16)."""

    first_token: Tensor
    features: list[Tensor | None]
    final: list[Tensor | None]


def _prefill(
    model: PreTrainedModel,
    slabs: list[SlabLayer],
    prompts: Sequence[Tensor],
    layers: tuple[int, ...],
    capture: bool,
    budget: int,
) -> _Prefill:
    """Run the prompts in groups of similar length and place their KV right-aligned in the cache's ``slabs``.

    Grouping keeps a 380-token prompt from padding thirty 40-token ones; the slab then
    holds every row left-padded to the longest prompt, exactly as one padded forward would.
    """
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    first = torch.zeros(len(prompts), dtype=torch.int64, device=model.device)
    features: list[Tensor | None] = [None] * len(prompts)
    final: list[Tensor | None] = [None] * len(prompts)
    lm_head = model.get_output_embeddings()
    for rows in batches_by_length(lengths, budget):
        group = lengths[rows]
        group_width = int(group.max())
        mask = torch.arange(group_width) >= (group_width - group)[:, None]  # [b, w] left padding
        ids = torch.zeros(len(rows), group_width, dtype=torch.int64)
        ids[mask] = torch.cat([prompts[i].long() for i in rows.tolist()])
        group_cache = DynamicCache(config=model.config)
        feats, last = decoder_states(
            model,
            ids.to(model.device),
            layers,
            attention_mask=mask.long().to(model.device),
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(model.device),
            cache=group_cache,
        )
        for slab, (keys, values) in zip(slabs, _prefilled_states(group_cache), strict=True):
            slab.write(rows.to(model.device), width - group_width, keys, values)
        first[rows.to(model.device)] = lm_head(last[:, -1]).argmax(-1)
        if capture:
            valid = mask.to(model.device)
            sizes = group.tolist()
            group_final = last[valid].to("cpu", FEATURE_DTYPE).split(sizes)
            group_feats: Sequence[Tensor | None] = [None] * len(sizes)
            if feats is not None:  # there are layers to capture
                group_feats = feats[valid].to("cpu", FEATURE_DTYPE).split(sizes)
            for position, index in enumerate(rows.tolist()):
                features[index], final[index] = group_feats[position], group_final[position]
    for slab in slabs:
        slab.set_length(width)
    return _Prefill(first, features, final)


@torch.inference_mode()
def greedy_generate(
    model: PreTrainedModel,
    prompts: Sequence[Tensor],
    max_new_tokens: int,
    eos_ids: Iterable[int],
    layers: Sequence[int] | None = None,
    prefill_tokens: int = 4096,
) -> list[Generation]:
    """Greedy decoding of a batch of prompts ``[P_i]`` with left padding and one preallocated KV cache.

    Equals ``generate(do_sample=False)`` per prompt (up to fp ties between batch shapes).
    Rows that emit an EOS stop being recorded, and leave the batch once a quarter of it has
    finished, so a long answer never makes the short ones pay for long. With ``layers``
    (possibly empty), the states of every fed token are captured on the way.
    """
    device, capture = model.device, layers is not None
    layers = tuple(layers or ())
    eos = torch.tensor(sorted(eos_ids), dtype=torch.int64, device=device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    batch, width = len(prompts), int(lengths.max())
    cache = slab_cache(model, batch, width + max_new_tokens)
    slabs = slab_layers(cache)
    if slabs is None:
        raise RuntimeError("slab_cache made a cache whose layers are not all slabs")
    prefill = _prefill(model, slabs, prompts, layers, capture, prefill_tokens)
    lm_head = model.get_output_embeddings()
    hidden = model.config.hidden_size
    steps = max(max_new_tokens - 1, 0)
    step_feats = torch.zeros(batch, steps, len(layers), hidden, dtype=FEATURE_DTYPE) if capture else None
    step_final = torch.zeros(batch, steps, hidden, dtype=FEATURE_DTYPE) if capture else None

    tokens = torch.zeros(batch, max_new_tokens, dtype=torch.int64, device=device)
    n_generated = torch.zeros(batch, dtype=torch.int64, device=device)
    rows = torch.arange(batch, device=device)  # batch row -> prompt index
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    attention = (torch.arange(width, device=device) >= (width - lengths)[:, None]).long()
    position = lengths - 1
    next_token = prefill.first_token
    for step in range(max_new_tokens):
        tokens[rows[alive], step] = next_token[alive]
        n_generated[rows[alive]] = step + 1
        alive &= ~torch.isin(next_token, eos)
        if step == max_new_tokens - 1 or not alive.any():
            break
        if 4 * int((~alive).sum()) >= len(alive):  # compact: finished rows leave the batch
            keep = alive.nonzero().squeeze(1)
            rows, alive, next_token, attention, position = (
                t[keep] for t in (rows, alive, next_token, attention, position)
            )
            drop_front = int((attention == 0).sum(1).min())  # left padding no kept row needs
            for slab in slabs:
                slab.compact(keep, drop_front)
            attention = attention[:, drop_front:]
        attention = torch.cat([attention, attention.new_ones(len(rows), 1)], dim=1)
        position = position + 1
        feats, final = decoder_states(
            model,
            next_token[:, None],
            layers,
            attention_mask=attention,
            position_ids=position[:, None],
            cache=cache,
        )
        if step_final is not None:  # capturing
            recorded = rows[alive].cpu()
            if step_feats is not None and feats is not None:
                step_feats[recorded, step] = feats[alive, 0].to("cpu", FEATURE_DTYPE)
            step_final[recorded, step] = final[alive, 0].to("cpu", FEATURE_DTYPE)
        next_token = lm_head(final[:, 0]).argmax(-1)

    results = []
    for row, count in enumerate(n_generated.tolist()):
        generation = Generation(tokens[row, :count].cpu())
        prompt_final, prompt_feats = prefill.final[row], prefill.features[row]
        if step_final is not None and prompt_final is not None:
            generation.final = torch.cat([prompt_final, step_final[row, : count - 1]])
        if step_feats is not None and prompt_feats is not None:
            generation.features = torch.cat([prompt_feats, step_feats[row, : count - 1]])
        results.append(generation)
    return results


def generate_chunk(
    model: PreTrainedModel,
    prompts: Sequence[Tensor],
    max_new_tokens: int,
    eos_ids: Iterable[int],
    batch_size: int,
    layers: Sequence[int] | None = None,
    prefill_tokens: int = 4096,
) -> list[Generation]:
    """:func:`greedy_generate` over batches of similar prompt length; results in input order."""
    eos_ids = tuple(eos_ids)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    results: dict[int, Generation] = {}
    for start in range(0, len(order), batch_size):
        indices = order[start : start + batch_size]
        batch = [prompts[i] for i in indices]
        generations = greedy_generate(model, batch, max_new_tokens, eos_ids, layers, prefill_tokens)
        results.update(zip(indices, generations, strict=True))
    return [results[i] for i in range(len(prompts))]


def _prefilled_states(cache: DynamicCache) -> list[tuple[Tensor, Tensor]]:
    """Each layer's ``(keys, values)`` of a prefilled cache of plain full-attention layers."""
    states = []
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
            raise RuntimeError(
                f"a prefill cache layer is a {type(layer).__name__}, not a filled full-attention one"
            )
        states.append((layer.keys, layer.values))
    return states
