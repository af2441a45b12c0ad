"""Target-regenerated training data: prompt selection and resumable shards of greedy answers.

The target answers each prompt greedily in its own batched decode loop
(:mod:`jetflow.drafters.training.greedy`), so the hidden states the feature cache needs are
captured during generation: the target never runs twice over the same tokens. A tokens-only
run may instead decode through an :class:`~jetflow.core.engine.Engine` (batched speculative
decoding, e.g. with the shipped head), whose greedy answers are the same tokens.
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
from jetflow.core.engine import Engine
from jetflow.core.errors import ConfigError, DataError
from jetflow.core.precision import dtype_name
from jetflow.core.target import Target
from jetflow.data.prompt_sets import Sample, prompt_key
from jetflow.drafters.training.corpus import Corpus, CorpusWriter, pack_shard, token_dtype, tokens_digest
from jetflow.drafters.training.feature_cache import FeatureWriter, feature_dir
from jetflow.drafters.training.features import check_layers
from jetflow.drafters.training.greedy import generate_chunk
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

DEFAULT_MAX_PROMPT_TOKENS = 384
DEFAULT_BATCH_SIZE = 32  # measured best on 2 CPU cores (batch 16: 0.6x)
DEFAULT_SHARD_SIZE = 128  # sorting 128 prompts by length keeps padding low; ~4 min a shard
#: the ``decoder`` a corpus header names for the loop of :mod:`jetflow.drafters.training.greedy`
#: (an engine's is its :attr:`~jetflow.core.engine.Engine.method`: ``ar``, ``jetflow:...``)
PLAIN_DECODER = "plain"


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
    engine: Engine | None = None,
) -> Corpus:
    """Let ``target`` answer ``prompts`` greedily and write the corpus (and features) to ``out``.

    Resumes after the last complete shard of ``out``. With ``layers`` (checked against the
    target), the same pass fills the feature cache at ``feature_folder`` (default
    :func:`feature_dir` of the corpus name); without, only tokens are written.

    ``engine`` (on ``target``, greedy, stopping at EOS only) answers each shard with
    :meth:`Engine.generate_batch` instead of the plain loop: the same tokens, decoded
    speculatively where its drafter pays. It writes no features (they need the states of
    every token, which only the plain loop captures), so ``layers`` must then be None. The
    header's ``settings`` name the ``decoder`` (and an engine's budget); the manifest's
    ``regeneration`` tokens/s compare the two.
    """
    out = Path(out)
    if engine is not None:
        _check_engine(engine, target, layers)
    header = {
        "source": source,
        "target": {"name": target.name, "fingerprint": target.fingerprint()},
        "settings": {
            "decoding": "greedy",
            **_decoder_settings(engine),
            "chat_template": target.has_chat_template,
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
            if engine is None:
                generations = generate_chunk(
                    target.model, prompt_ids, max_new_tokens, target.eos_token_ids, batch_size, layers
                )
                responses = [g.response for g in generations]
            else:
                results = engine.generate_batch(
                    [list(p.token_ids) for p in chunk], max_new_tokens=max_new_tokens, batch_size=batch_size
                )
                responses = [torch.tensor(r.token_ids, dtype=torch.int64) for r in results]
            sequences = [torch.cat([p, r]) for p, r in zip(prompt_ids, responses, strict=True)]
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


def _check_engine(engine: Engine, target: Target, layers: Sequence[int] | None) -> None:
    """Refuse an engine whose answers would not be the plain loop's greedy ones, or features."""
    if layers is not None:
        raise ConfigError(
            "an engine decodes tokens only: features need the states of every token, which the "
            "plain greedy loop captures (ask for no feature layers, or decode without an engine)"
        )
    if engine.target.model is not target.model:  # the same weights, not merely the same shapes
        raise ConfigError(f"the engine decodes with {engine.target.name}, not the target {target.name}")
    config = engine.config
    if config.verifier != "greedy" or config.stop or not config.stop_at_eos:
        raise ConfigError(
            "regeneration needs greedy answers that end at EOS or max_new_tokens only: the engine has "
            f"verifier={config.verifier!r}, stop={list(config.stop)}, stop_at_eos={config.stop_at_eos}"
        )


def _decoder_settings(engine: Engine | None) -> dict[str, object]:
    """What decoded the answers: the plain loop, or an engine's method and tree budget."""
    if engine is None:
        return {"decoder": PLAIN_DECODER}
    return {
        "decoder": engine.method,
        "budget": engine.budget,
        "budget_source": engine.budget_source,
        "compiled": engine.target.compiled is not None,
    }
