"""Target-regenerated training data: prompt selection, batched greedy decoding, resumable shards.

The target answers each prompt greedily in its own batched decode loop, so the hidden
states the feature cache needs are captured during generation: the target never runs
twice over the same tokens. On a CPU the loop is bound by memory traffic as much as by
arithmetic, hence: prompts prefilled in groups of similar length, one KV slab written in
place (:mod:`jetflow.core.kv_cache`), finished rows and padding no row needs dropped as they appear.
Prompts go through in fixed-size shards; each complete shard is written atomically, so an
interrupted run resumes after its last complete shard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from jetflow.core.errors import DataError
from jetflow.core.kv_cache import SlabLayer, slab_cache, slab_layers
from jetflow.core.precision import dtype_name
from jetflow.core.target import Target
from jetflow.data.prompt_sets import Sample, prompt_key
from jetflow.drafters.training.corpus import Corpus, CorpusWriter, pack_shard, token_dtype, tokens_digest
from jetflow.drafters.training.feature_cache import FEATURE_DTYPE, FeatureWriter, feature_dir
from jetflow.drafters.training.features import batches_by_length, check_layers, decoder_states
from torch import Tensor
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

log = logging.getLogger(__name__)

DEFAULT_MAX_PROMPT_TOKENS = 384
DEFAULT_BATCH_SIZE = 32  # measured best on 2 CPU cores (batch 16: 0.6x)
DEFAULT_SHARD_SIZE = 128  # sorting 128 prompts by length keeps padding low; ~4 min a shard


@dataclass(frozen=True)
class Prompt:
    """One prompt ready for the target: its sample id and token ids (chat template applied)."""

    id: str
    token_ids: tuple[int, ...]


@dataclass
class Selection:
    """The prompts kept, in source order, and why the others were skipped (ids per reason)."""

    prompts: list[Prompt]
    scanned: int
    skipped: dict[str, list[str]] = field(default_factory=dict)

    def describe(self) -> dict[str, object]:
        return {"scanned": self.scanned, "kept": len(self.prompts), "skipped": self.skipped}


def select_prompts(
    samples: Iterable[Sample],
    encode: Callable[[str], list[int]],
    n: int,
    *,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    exclude: Iterable[str] = (),
) -> Selection:
    """The first ``n`` usable first turns of ``samples``, in order.

    Skipped: texts equal (up to whitespace) to an ``exclude`` text (the benchmark prompts),
    repeats of an earlier prompt, and prompts over ``max_prompt_tokens`` after ``encode``.
    Stops scanning once ``n`` are kept, so the choice for ``n`` is a prefix of that for more.
    """
    excluded = {prompt_key(t) for t in exclude}
    seen: set[str] = set()
    kept: list[Prompt] = []
    skipped: dict[str, list[str]] = {"benchmark_overlap": [], "duplicate_prompt": [], "prompt_too_long": []}
    scanned = 0
    for sample in samples:
        if len(kept) >= n:
            break
        scanned += 1
        text = prompt_key(sample.turns[0])
        if text in excluded:
            skipped["benchmark_overlap"].append(sample.id)
            continue
        if text in seen:
            skipped["duplicate_prompt"].append(sample.id)
            continue
        seen.add(text)
        ids = encode(sample.turns[0])
        if len(ids) > max_prompt_tokens:
            skipped["prompt_too_long"].append(sample.id)
            continue
        kept.append(Prompt(sample.id, tuple(ids)))
    if len(kept) < n:
        log.warning("only %d usable prompts in the source (asked for %d)", len(kept), n)
    return Selection(kept, scanned, skipped)


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


def regenerate(
    target: Target,
    prompts: Sequence[Prompt],
    out: Path,
    *,
    max_new_tokens: int = 256,
    batch_size: int = DEFAULT_BATCH_SIZE,
    shard_size: int = DEFAULT_SHARD_SIZE,
    layers: Sequence[int] | None = None,
    feature_folder: Path | None = None,
    source: str = "sharegpt",
    selection: dict | None = None,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    show_progress: bool = False,
) -> Corpus:
    """Let ``target`` answer ``prompts`` greedily and write the corpus (and features) to ``out``.

    Resumes after the last complete shard of ``out``. With ``layers`` (checked against the
    target), the same pass fills the feature cache at ``feature_folder`` (default
    :func:`feature_dir` of the corpus name); without, only tokens are written.
    """
    out = Path(out)
    header = {
        "source": source,
        "target": {"name": target.name, "fingerprint": target.fingerprint()},
        "settings": {
            "decoding": "greedy",
            "chat_template": True,
            "max_new_tokens": max_new_tokens,
            "max_prompt_tokens": max_prompt_tokens,
            "dtype": dtype_name(target.dtype),
            "batch_size": batch_size,
            "shard_size": shard_size,
            "device": str(target.device),
            "threads": torch.get_num_threads(),
        },
        "selection": selection or {},
    }
    writer = CorpusWriter(out, header)
    done = writer.n_sequences
    expected = [p.id for p in prompts[:done]]
    if writer.manifest["ids"] != expected:
        raise DataError(
            f"{out}: its {done} conversations are not the first of this run's prompts; use another --out"
        )
    features = None
    if layers is not None:
        layers = check_layers(layers, target.num_layers)
        features = FeatureWriter.for_target(
            feature_folder or feature_dir(out.resolve().name, layers),
            corpus_name=out.resolve().name,
            target=target,
            layers=layers,
        )
        missing = [
            i for i, s in enumerate(writer.manifest["shards"]) if not features.has(i, s["tokens_sha256"])
        ]
        if missing:
            log.warning(
                "%d complete shards have no cached features: run `jetflow data features`", len(missing)
            )
    dtype = token_dtype(target.vocab_size)
    todo = prompts[done:]
    log.info("regenerating %d conversations (%d already in %s)", len(todo), done, out)
    with tqdm(
        total=len(prompts), initial=done, unit="conv", desc="regenerate", disable=not show_progress
    ) as bar:
        for start in range(0, len(todo), shard_size):
            chunk = todo[start : start + shard_size]
            began, began_cpu = time.perf_counter(), time.process_time()
            prompt_ids = [torch.tensor(p.token_ids, dtype=torch.int64) for p in chunk]
            generations = generate_chunk(
                target.model, prompt_ids, max_new_tokens, target.eos_token_ids, batch_size, layers
            )
            sequences = [torch.cat([p, g.response]) for p, g in zip(prompt_ids, generations, strict=True)]
            shard = pack_shard([p.id for p in chunk], sequences, [len(p) for p in prompt_ids], dtype)
            if features is not None:
                states = [g.captured() for g in generations]
                features.write(
                    writer.n_shards,
                    tokens_digest(shard.tokens),
                    [feats for feats, _ in states],
                    [final for _, final in states],
                )
            writer.append(shard, time.perf_counter() - began, time.process_time() - began_cpu)
            bar.update(len(chunk))
            rate = writer.manifest["regeneration"]["response_tokens_per_s"]
            bar.set_postfix(tok_s=f"{rate:.0f}")
    return Corpus(out)


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
