"""Benchmark and training prompt sets, read only from files shipped in installed packages.

Every set yields :class:`Sample` objects holding the *user* turns of a conversation; the
benchmark runner produces the assistant turns itself. The files are read as
:mod:`jetflow.data.shipped_files` says; the two that ``datasets`` cannot parse (the truncated
ShareGPT array, the nested CHAMP dict) are parsed here with the stdlib.

Order: every set keeps the order of its shipped file, so the first ``limit`` samples are
the same on every machine. That order is meaningful for all of them: HumanEval/0..163,
MT-Bench question 81..160, CHAMP by category then problem number, ShareGPT as published
(its last conversations are the held-out split ``sharegpt-heldout``).
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from jetflow.core.errors import ConfigError, DataError
from jetflow.data.shipped_files import READ_ERRORS, LoadReport, cached_rows, load_jsonl, shipped_path

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

BENCHMARK_NAMES: tuple[str, ...] = ("champ", "humaneval", "mtbench", "sharegpt-heldout")
DATASET_NAMES: tuple[str, ...] = (*BENCHMARK_NAMES, "sharegpt")
#: The last this many recovered ShareGPT conversations are the held-out evaluation split:
#: no training prompt is ever drawn from them (see :func:`split_sharegpt`).
SHAREGPT_HELDOUT_SIZE = 1000
FILE_PREFIX = "file:"

#: HumanEval ships bare function stubs; a chat model needs an instruction around them.
#: Every prompt ends with a newline, so the closing fence sits on its own line.
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n\n```python\n{prompt}```"

_WHITESPACE = re.compile(r"[ \t\n\r]*")  # JSON whitespace; a match never copies the text


def _skip_whitespace(text: str, pos: int) -> int:
    """The first position at or after ``pos`` that is not JSON whitespace (the pattern matches
    the empty string, so it always matches)."""
    match = _WHITESPACE.match(text, pos)
    return match.end() if match else pos


@dataclass(frozen=True)
class Sample:
    """One prompt: the user turns in order (MT-Bench has two, most sets one)."""

    id: str
    dataset: str
    turns: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.turns or not all(isinstance(t, str) and t.strip() for t in self.turns):
            raise ValueError(f"sample {self.id!r}: needs user turns that are non-empty strings")

    def messages(self) -> list[dict[str, str]]:
        """Chat messages for the first turn, ready for a chat template."""
        return [{"role": "user", "content": self.turns[0]}]


def _to_samples(ds: datasets.Dataset, name: str) -> list[Sample]:
    cols = ds.to_dict()
    return [Sample(i, name, tuple(t)) for i, t in zip(cols["id"], cols["turns"], strict=True)]


def _parse_champ(path: Path) -> tuple[dict[str, list], Counter[str]]:
    try:
        problems = json.loads(path.read_text(encoding="utf-8"))["problems"]
        pairs = [(str(pid), p["_text"]) for pid, p in problems.items()]
        if not all(isinstance(t, str) and t.strip() for _, t in pairs):
            raise ValueError("a problem has no _text")
    except (*READ_ERRORS, KeyError, TypeError, AttributeError) as exc:
        raise DataError(f"{path}: not a CHAMP file ({type(exc).__name__}: {exc})") from exc
    return {"id": [p for p, _ in pairs], "turns": [[t] for _, t in pairs]}, Counter()


def _recover_sharegpt(path: Path) -> tuple[dict[str, list], Counter[str]]:
    """Decode the array record by record, keeping every complete conversation.

    JSON has no safe point to resynchronise after a broken record, so the first
    undecodable record ends recovery: it (with whatever follows) counts as one drop.
    """
    try:
        text = path.read_text(encoding="utf-8-sig")
    except READ_ERRORS as exc:
        raise DataError(f"{path}: cannot read ShareGPT file ({exc})") from exc
    start = _skip_whitespace(text, 0)
    if text[start : start + 1] != "[":
        raise DataError(f"{path}: not a JSON array of ShareGPT conversations")
    decoder, pos, end = json.JSONDecoder(), start + 1, len(text)
    ids: list[str] = []
    turns: list[list[str]] = []
    dropped: Counter[str] = Counter()
    while True:
        pos = _skip_whitespace(text, pos)
        if pos >= end:
            logger.warning("%s: the array is never closed (file truncated)", path.name)
            break
        if text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            dropped["incomplete or malformed record (end of recovery)"] += 1
            logger.info("%s: record at char %d of %d does not decode", path.name, pos, end)
            break
        human = _human_turns(record)
        if human:
            ids.append(str(record["id"]))
            turns.append(human)
        else:
            dropped["no id or no non-empty human turn"] += 1
        pos = _skip_whitespace(text, pos)
        if text[pos : pos + 1] == ",":
            pos += 1
    return {"id": ids, "turns": turns}, dropped


def _human_turns(record: object) -> list[str]:
    """The non-empty human turns; none for anything but an ``{id, conversations}`` record."""
    if not isinstance(record, dict) or not record.get("id"):
        return []
    conversation = record.get("conversations")
    return [
        m["value"]
        for m in (conversation if isinstance(conversation, list) else [])
        if isinstance(m, dict)
        and m.get("from") == "human"
        and isinstance(m.get("value"), str)
        and m["value"].strip()
    ]


def load_champ(path: Path | str | None = None) -> list[Sample]:
    """The 270 CHAMP competition problems (statement text only, no hints)."""
    path = Path(path) if path else shipped_path("champ")
    return _to_samples(cached_rows("champ", path, _parse_champ)[0], "champ")


def load_humaneval(path: Path | str | None = None) -> list[Sample]:
    """The 164 HumanEval stubs, wrapped in :data:`HUMANEVAL_TEMPLATE`."""
    path = Path(path) if path else shipped_path("humaneval")
    try:
        rows = [(r["task_id"], r["prompt"]) for r in load_jsonl(path)]
        return [Sample(t, "humaneval", (HUMANEVAL_TEMPLATE.format(prompt=p),)) for t, p in rows]
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path}: not a HumanEval file ({type(exc).__name__}: {exc})") from exc


def load_mtbench(path: Path | str | None = None) -> list[Sample]:
    """The 80 MT-Bench questions, two user turns each."""
    path = Path(path) if path else shipped_path("mtbench")
    try:
        return [Sample(str(r["question_id"]), "mtbench", tuple(r["turns"])) for r in load_jsonl(path)]
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path}: not an MT-Bench file ({type(exc).__name__}: {exc})") from exc


def load_sharegpt_with_report(path: Path | str | None = None) -> tuple[list[Sample], LoadReport]:
    """ShareGPT conversations (human turns only) plus what was recovered and dropped."""
    path = Path(path) if path else shipped_path("sharegpt")
    ds, report = cached_rows("sharegpt", path, _recover_sharegpt)
    reasons = dict(report.dropped_by_reason)
    logger.info("%s: recovered %d, dropped %d %s", path.name, report.recovered, report.dropped, reasons)
    return _to_samples(ds, "sharegpt"), report


def load_sharegpt(path: Path | str | None = None) -> list[Sample]:
    """ShareGPT conversations; see :func:`load_sharegpt_with_report` for the drop counts."""
    return load_sharegpt_with_report(path)[0]


def prompt_key(text: str) -> str:
    """Whitespace-normalised text: what "the same prompt" means for overlap and repeats."""
    return " ".join(text.split())


def split_sharegpt(samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """``(training side, held-out split)`` of the recovered ShareGPT conversations.

    The held-out split is the last :data:`SHAREGPT_HELDOUT_SIZE` conversations of the file,
    less those whose first turn repeats (up to whitespace) one seen before it in the file:
    a repeated prompt may already be in a training corpus, so it is not held out.
    """
    training, tail = samples[:-SHAREGPT_HELDOUT_SIZE], samples[-SHAREGPT_HELDOUT_SIZE:]
    seen = {prompt_key(s.turns[0]) for s in training}
    heldout = []
    for sample in tail:
        key = prompt_key(sample.turns[0])
        if key not in seen:
            seen.add(key)
            heldout.append(Sample(sample.id, "sharegpt-heldout", sample.turns))
    return training, heldout


def load_sharegpt_heldout(path: Path | str | None = None) -> list[Sample]:
    """The held-out ShareGPT split (:func:`split_sharegpt`), as a benchmark set."""
    return split_sharegpt(load_sharegpt(path))[1]


def load_prompt_file(path: Path | str) -> list[Sample]:
    """A user's jsonl: ``{"prompt": str}`` or ``{"messages": [{role, content}, ...]}`` a line.

    Parsed with the stdlib rather than ``datasets`` so that errors can name the line.
    """
    path = Path(path)
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as exc:
        raise DataError(f"{path}: cannot read prompt file ({exc})") from exc
    samples = []
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            turns = _user_turns(record)
            samples.append(Sample(str(record.get("id", lineno)), f"{FILE_PREFIX}{path}", turns))
        except ValueError as exc:  # also JSONDecodeError and UnicodeDecodeError
            raise DataError(f"{path}: line {lineno}: {exc}") from exc
    if not samples:
        raise DataError(f"{path}: no prompts in file")
    return samples


def _user_turns(record: object) -> tuple[str, ...]:
    if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
        raise ValueError('expected an object with exactly one of "prompt" or "messages"')
    if "prompt" in record:
        return (record["prompt"],)
    messages = record["messages"]
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise ValueError('"messages" must be a list of {"role": ..., "content": ...} objects')
    return tuple(m["content"] for m in messages if m["role"] == "user")


_LOADERS: dict[str, Callable[[], list[Sample]]] = {
    "champ": load_champ,
    "humaneval": load_humaneval,
    "mtbench": load_mtbench,
    "sharegpt": load_sharegpt,
    "sharegpt-heldout": load_sharegpt_heldout,
}


def load_dataset_samples(name: str, limit: int | None = None) -> list[Sample]:
    """The first ``limit`` samples (all if None) of a named set or of ``file:PATH``."""
    if limit is not None and limit < 0:
        raise ConfigError(f"dataset limit must be >= 0, got {limit}")
    if name.startswith(FILE_PREFIX):
        samples = load_prompt_file(name[len(FILE_PREFIX) :])
    elif name in _LOADERS:
        samples = _LOADERS[name]()
    else:
        known = ", ".join(DATASET_NAMES)
        raise ConfigError(f"unknown dataset {name!r}; known datasets: {known}, or file:PATH.jsonl")
    return samples if limit is None else samples[:limit]


def benchmark_prompt_texts(every_turn: bool = False) -> set[str]:
    """User-turn texts of every benchmark set: the prompts training data must never contain.

    Regeneration skips a training prompt equal to one of them (compared through
    :func:`prompt_key`), so no drafter is trained on what it is measured on. First-turn
    regeneration checks the first turns only (the committed corpus was selected so, and a
    resumed selection must stay a prefix of it); second turns check ``every_turn``, which adds
    the follow-ups (MT-Bench's turn 2, the held-out split's later turns).
    """
    return {
        text
        for name in BENCHMARK_NAMES
        for sample in _LOADERS[name]()
        for text in (sample.turns if every_turn else sample.turns[:1])
    }
