"""The results of a comparison run and their JSON form (``results.json``).

Schema (the keys every consumer may rely on; each run carries more detail after them)::

    {"machine": {...}, "target": str, "settings": {...},
     "runs": [{"method": str, "dataset": str, "budget": int | null, "n_prompts": int,
               "new_tokens": int, "tau": float, "tokens_per_s": float, "speedup_vs_ar": float,
               "draft_share": float, "lossless": bool | null, "dtype": str, ...}]}

``lossless`` is null for sampled runs (temperature > 0), whose outputs are not compared.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetflow.bench.config import BATCH_FIELDS, DrafterSpec
from jetflow.core.atomic import write_json_atomic
from jetflow.core.config import AUTO_BUDGET
from jetflow.core.errors import ConfigError

#: the keys of a run that the issue fixes, in order, with their JSON types
RUN_KEYS: dict[str, tuple[type, ...]] = {
    "method": (str,),
    "dataset": (str,),
    "budget": (int, type(None)),
    "n_prompts": (int,),
    "new_tokens": (int,),
    "tau": (float,),
    "tokens_per_s": (float,),
    "speedup_vs_ar": (float,),
    "draft_share": (float,),
    "lossless": (bool, type(None)),
    "dtype": (str,),
}


@dataclass
class BenchResults:
    """Everything ``results.json`` holds."""

    machine: dict[str, Any]
    target: str
    settings: dict[str, Any]
    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def lossless(self) -> bool:
        """False if any run diverged for real (rounding ties and unchecked sampled runs do not count)."""
        return all(run["lossless"] is not False for run in self.runs)

    def failures(self) -> list[str]:
        """One line per real divergence, for the CLI's error message."""
        lines = []
        for run in self.runs:
            budget = "" if run["budget"] is None else f" budget {run['budget']}"
            batch = f" batch {run['batch_size']}" if "batch_size" in run else ""
            for d in run.get("divergences", []):
                if d["kind"] == "bug":
                    against = f" ({d['against']})" if "against" in d else ""
                    lines.append(
                        f"{run['method']}{budget}{batch} on {run['dataset']} sample {d['sample_id']} "
                        f"turn {d['turn']}: token {d['position']} is {d['got']}, baseline{against} "
                        f"has {d['expected']}"
                    )
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {"machine": self.machine, "target": self.target, "settings": self.settings, "runs": self.runs}

    def write_json(self, path: Path) -> Path:
        """Write ``path`` atomically: a reader (or a killed run) never sees half a file."""
        write_json_atomic(path, self.to_dict(), indent=2)
        return path

    @classmethod
    def read_json(cls, path: Path) -> BenchResults:
        try:
            data = json.loads(Path(path).read_text())
            return cls(data["machine"], data["target"], data["settings"], data["runs"])
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ConfigError(f"{path} is not a complete jetflow results file ({error})") from None


#: settings that may differ between the processes of a resumed run
_RESUME_FREE = frozenset({"out", "command", "commands", "datasets", "n_samples"})


def _as_requested(methods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``methods`` as asked for: an ``auto`` run's starting budget is what this machine's
    calibration chose (a measurement, recorded in each run), not a setting."""
    return [m | {"budget": None} if m["method"].endswith(f"@{AUTO_BUDGET}") else m for m in methods]


def _measured_variants(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with ``variants`` cut to those its drafters run: a variant the config
    defines but no run measures changes no figure, so adding one must not stop a resume."""
    defined = settings.get("variants")
    if not defined:
        return settings
    runs = {name: variant["drafter"] for name, variant in defined.items()}
    used = {DrafterSpec.parse(entry, runs).variant for entry in settings.get("drafters", [])}
    return settings | {"variants": {name: defined[name] for name in defined if name in used}}


def check_compatible(previous: BenchResults, current: BenchResults, *, across_datasets: bool = False) -> None:
    """Refuse to mix figures measured under different settings into one table.

    Each data set is measured whole in one process, ar included, so speedups stay
    same-process ratios however many processes (resumed or side by side) fill one results
    file; only the data sets may differ between them, and (``across_datasets``) the budget
    each ``auto`` run started from, which the process's calibration chose. Within one data
    set (a journal's samples) that budget must agree too, or one row would mix two runs.
    """
    if previous.target != current.target:
        raise ConfigError(
            f"cannot resume: the results are for target {previous.target!r}, not {current.target!r}"
        )
    settings = [_measured_variants(previous.settings), _measured_variants(current.settings)]
    if across_datasets:
        settings = [s | {"methods": _as_requested(s["methods"])} if "methods" in s else s for s in settings]
    keys = (set(settings[0]) | set(settings[1])) - _RESUME_FREE
    differ = sorted(key for key in keys if settings[0].get(key) != settings[1].get(key))
    if differ:
        shown = ", ".join(f"{key} ({settings[0].get(key)!r} -> {settings[1].get(key)!r})" for key in differ)
        raise ConfigError(f"cannot resume: the saved results were measured with other settings: {shown}")
    for name, count in previous.settings.get("n_samples", {}).items():
        if name in current.settings["n_samples"] and current.settings["n_samples"][name] != count:
            raise ConfigError(
                f"cannot resume: {name} had {count} samples, now {current.settings['n_samples'][name]}"
            )


def merge_saved(path: Path, results: BenchResults) -> BenchResults:
    """Add ``results``' data sets to the results file at ``path`` (created if missing) and
    return what the file then holds.

    Several processes may fill one file, one data set each: the read-merge-write runs under
    an exclusive lock and the file is replaced atomically, so none loses another's runs.
    A data set already in the file is kept as it was measured there.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with (path.parent / f".{path.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            merged = results
        else:
            merged = BenchResults.read_json(path)
            check_compatible(merged, results, across_datasets=True)
            saved = {run["dataset"] for run in merged.runs}
            added = [run for run in results.runs if run["dataset"] not in saved]
            if not added:
                return merged  # a resume with nothing left to measure filled nothing
            merged.runs += added
            n_samples = merged.settings.get("n_samples", {}) | results.settings.get("n_samples", {})
            datasets = list(
                dict.fromkeys([*merged.settings.get("datasets", []), *results.settings.get("datasets", [])])
            )
            commands = [*merged.settings.get("commands", [merged.settings.get("command")])]
            commands = list(dict.fromkeys(c for c in [*commands, results.settings.get("command")] if c))
            merged.settings = results.settings | {"n_samples": n_samples, "datasets": datasets}
            merged.settings["commands"] = commands  # one per process that filled the file
        merged.write_json(path)
    return merged


def refuse_other_results(path: Path, config: Mapping[str, Any]) -> None:
    """Refuse to replace the results file at ``path`` with a run of other settings.

    ``config`` is the new run's config (its JSON form, as its settings record it). A run that
    starts anew (no ``--resume``) on the settings already saved there measures the same
    comparison again; on any other settings (data sets included) it would silently drop what
    the file holds, so the user must say ``--resume`` or ``--overwrite``, or pick another folder.
    """
    if not path.exists():
        return
    choices = "pass --resume to add to them, --overwrite to replace them, or choose another --out"
    try:
        saved = BenchResults.read_json(path).settings
    except ConfigError as error:
        raise ConfigError(f"{error}; {choices}") from None
    # the batch axis is recorded only where a run has one: its absence is a setting too
    keys = ((set(saved) & set(config)) | (BATCH_FIELDS & (set(saved) | set(config)))) - {"out"}
    differ = sorted(key for key in keys if saved.get(key) != config.get(key))
    if differ:
        shown = ", ".join(f"{key} ({saved.get(key)!r} -> {config.get(key)!r})" for key in differ)
        raise ConfigError(f"{path.parent} holds results measured with other settings: {shown}; {choices}")
