"""Second turns: the target answers a conversation's follow-up after its *own* first answer.

A second-turn corpus is a sibling folder of a first-turn corpus (``<name>-turn2`` beside
``<name>``), in the same shard format. Each of its prompts is the chat template of
``[user turn 1, assistant = the first-turn corpus's answer, user turn 2]``, built exactly
as the benchmark builds MT-Bench's second turns (the answer decoded without special
tokens), so the head trains on the contexts it later drafts in.

Why a sibling folder rather than entries of the first-turn corpus: the first-turn
regeneration appends to its folder while this one runs (one process per core), and two
writers of one manifest would race; a sibling also keeps every shard's prompt rule
uniform, and the trainer and ``jetflow data stats`` read both (``corpus.training_corpus_dirs``).

Prompts follow the first-turn corpus's order, so the prompt list of a later run (over a
parent that has grown) extends that of an earlier one and :func:`regenerate` resumes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from jetflow.core.target import Target
from jetflow.data.prompt_sets import Sample, prompt_key
from jetflow.drafters.training.corpus import MANIFEST_NAME, Corpus, read_manifest
from jetflow.drafters.training.regenerate import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_SHARD_SIZE,
    Prompt,
    Selection,
    regenerate,
)

log = logging.getLogger(__name__)

#: a first turn (<= 384 tokens) plus its answer (<= 256) plus a follow-up; longer ones
#: would make the KV slab, which every decoding step reads, dominate the cost of a batch
DEFAULT_MAX_PROMPT_TOKENS = 1024


def parent_complete(parent: Corpus) -> bool:
    """Whether the first-turn run has written every prompt it selected (its ``--n``)."""
    return len(parent) >= int(parent.manifest.get("selection", {}).get("kept", 0))


def select_second_turns(
    parent: Corpus,
    samples: Mapping[str, Sample],
    decode: Callable[[list[int]], str],
    encode: Callable[[list[dict[str, str]]], list[int]],
    *,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    exclude: Iterable[str] = (),
) -> Selection:
    """One prompt per conversation of ``parent`` (in its order) whose source has a second user turn.

    ``samples`` maps the parent's ids to their source conversations; ``decode`` turns the
    parent's response tokens into the assistant's text and ``encode`` applies the chat
    template. Skipped: conversations without a second turn, follow-ups equal (up to
    whitespace) to an ``exclude`` text (the benchmarks' turns), prompts over ``max_prompt_tokens``.
    """
    excluded = {prompt_key(t) for t in exclude}
    kept: list[Prompt] = []
    skipped: dict[str, list[str]] = {
        "missing_source": [],
        "no_second_turn": [],
        "benchmark_overlap": [],
        "prompt_too_long": [],
    }
    for index, sample_id in enumerate(parent.ids):
        sample = samples.get(sample_id)
        if sample is None:
            skipped["missing_source"].append(sample_id)
            continue
        if len(sample.turns) < 2:
            skipped["no_second_turn"].append(sample_id)
            continue
        if prompt_key(sample.turns[1]) in excluded:
            skipped["benchmark_overlap"].append(sample_id)
            continue
        tokens, prompt_length = parent.sequence(index)
        messages = [
            {"role": "user", "content": sample.turns[0]},
            {"role": "assistant", "content": decode(tokens[prompt_length:].tolist())},
            {"role": "user", "content": sample.turns[1]},
        ]
        ids = encode(messages)
        if len(ids) > max_prompt_tokens:
            skipped["prompt_too_long"].append(sample_id)
            continue
        kept.append(Prompt(sample_id, tuple(ids)))
    return Selection(kept, len(parent), skipped)


def _written(out: Path) -> int:
    return len(read_manifest(out)["ids"]) if (out / MANIFEST_NAME).exists() else 0


def regenerate_second_turns(
    target: Target,
    parent_dir: Path,
    out: Path,
    samples: Mapping[str, Sample],
    *,
    exclude: Iterable[str] = (),
    follow: bool = False,
    limit: int | None = None,
    layers: Sequence[int] | None = None,
    poll_s: float = 120.0,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    shard_size: int = DEFAULT_SHARD_SIZE,
    source_info: dict | None = None,
    show_progress: bool = False,
) -> Corpus | None:
    """Answer the second turns of the corpus at ``parent_dir`` into ``out`` (resumable).

    Without ``follow``, every second turn the parent has now is answered. With ``follow``,
    the parent is re-read after every pass (and every ``poll_s`` seconds while it has
    nothing new); only full shards are answered until the parent's run is complete, and
    the call returns once a pass over the complete parent finds nothing left to answer.
    With ``layers``, the target's features are cached on the way (as for first turns).
    ``limit`` caps the number of second turns (the corpus is then complete at that many).
    Returns the corpus written (``None`` if nothing was).
    """
    exclude = tuple(exclude)
    out = Path(out)
    while True:
        parent = Corpus(parent_dir)
        complete = parent_complete(parent)
        selection = select_second_turns(
            parent,
            samples,
            target.decode,
            target.encode_prompt,
            max_prompt_tokens=max_prompt_tokens,
            exclude=exclude,
        )
        prompts = selection.prompts[:limit]
        complete = complete or (limit is not None and len(prompts) >= limit)
        if follow and not complete:
            prompts = prompts[: len(prompts) // shard_size * shard_size]
        fresh = len(prompts) > _written(out)
        if fresh:
            regenerate(
                target,
                prompts,
                out,
                max_new_tokens=max_new_tokens,
                batch_size=batch_size,
                shard_size=shard_size,
                layers=layers,
                source="sharegpt-turn2",
                selection={"parent": parent.name, **(source_info or {}), **selection.describe()},
                max_prompt_tokens=max_prompt_tokens,
                show_progress=show_progress,
            )
        if not follow or (complete and not fresh):
            return Corpus(out) if (out / MANIFEST_NAME).exists() else None
        if not fresh:
            log.info("waiting for %s to grow (%d of its conversations so far)", parent.path, len(parent))
            time.sleep(poll_s)
