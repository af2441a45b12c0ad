"""A data set resumed part-way: each finished sample's records, journaled the moment it ends.

Long multi-turn data sets take longer at one thread than a session lasts. The runner measures one
sample with every method back to back (``ar`` first), so a sample is the smallest unit whose
ratios need nothing else: its records go to ``<out>/journal/<data set>.jsonl`` as soon as it is
done, and a resumed run with the same settings reads them back and goes on with the next sample.
The runner removes the file once its data set's rows are saved.

Format: a JSON-lines file whose first line is ``{"target", "settings", "machine"}`` (compared on
resume: the settings like ``results.json``'s, the machine by kind) and every further line one
sample: ``{"sample_id", "turns": [{"prompt_ids", "records": [one per method, in the settings'
method order]}]}``. A last line cut off by a killed process is dropped (its sample is measured
again); any other damage is an error.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from jetflow.bench.generation import Generation
from jetflow.bench.lossless import Divergence
from jetflow.bench.metrics import TurnRecord
from jetflow.bench.results import BenchResults, check_compatible
from jetflow.core.errors import ConfigError

log = logging.getLogger(__name__)

#: per method, that method's records of one sample's turns
SampleRecords = list[list[TurnRecord]]
#: what a speed depends on (``describe_machine``'s keys): a data set's samples share them
SAME_MACHINE_KEYS = ("cpu", "cpu_count", "device", "accelerator", "native_bf16", "torch", "transformers")


def journal_path(folder: Path, dataset: str) -> Path:
    """The journal of ``dataset`` under ``folder``: a readable, collision-free file name
    (``file:PATH`` data sets carry slashes)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", dataset).strip("_")[:60]
    digest = hashlib.sha1(dataset.encode()).hexdigest()[:8]
    return folder / f"{slug}-{digest}.jsonl"


def _record_json(record: TurnRecord) -> dict[str, Any]:
    divergence = None if record.divergence is None else record.divergence.as_dict()
    return {**asdict(record.generation), "divergence": divergence}


def _record_from_json(sample_id: str, turn: int, prompt_ids: tuple[int, ...], data: dict) -> TurnRecord:
    fields = dict(data)
    divergence = fields.pop("divergence")
    for name in ("token_ids", "accepted", "budgets"):
        if fields[name] is not None:
            fields[name] = tuple(fields[name])
    return TurnRecord(
        sample_id,
        turn,
        prompt_ids,
        Generation(**fields),
        None if divergence is None else Divergence(**divergence),
    )


def _sample_json(sample_id: str, records: SampleRecords) -> dict[str, Any]:
    turns = [
        {"prompt_ids": list(turn_records[0].prompt_ids), "records": [_record_json(r) for r in turn_records]}
        for turn_records in zip(*records, strict=True)
    ]
    return {"sample_id": sample_id, "turns": turns}


def _sample_from_json(data: dict[str, Any], n_methods: int) -> SampleRecords:
    records: SampleRecords = [[] for _ in range(n_methods)]
    for turn, entry in enumerate(data["turns"]):
        prompt_ids = tuple(entry["prompt_ids"])
        if len(entry["records"]) != n_methods:
            raise ValueError(f"{len(entry['records'])} records for {n_methods} methods")
        for method_records, record in zip(records, entry["records"], strict=True):
            method_records.append(_record_from_json(data["sample_id"], turn, prompt_ids, record))
    return records


class SampleJournal:
    """The journal of one data set, held under an exclusive lock while its process measures it."""

    def __init__(
        self, path: Path, handle: IO[str], n_methods: int, finished: dict[str, SampleRecords]
    ) -> None:
        self.path = path
        self._handle = handle
        self._n_methods = n_methods
        #: records of the samples measured before this process started, by sample id
        self.finished = finished

    @classmethod
    def open(
        cls,
        path: Path,
        target: str,
        settings: Mapping[str, Any],
        machine: Mapping[str, Any],
        resume: bool,
    ) -> SampleJournal:
        """Open (``resume``: read back, else start anew) the journal at ``path``.

        Raises ConfigError where another process holds it, or where it was written under other
        settings, on another kind of machine, or is damaged.
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise ConfigError(
                f"another process is measuring into {path}; give each process its own --datasets"
            ) from None
        n_methods = len(settings["methods"])
        try:
            handle.seek(0)
            finished, kept = cls._read(path, handle.read(), target, settings, machine) if resume else ({}, 0)
        except ConfigError:
            handle.close()
            raise
        handle.truncate(kept)  # a cut-off last line goes; nothing measured is rewritten
        if kept == 0:
            header = {"target": target, "settings": dict(settings), "machine": dict(machine)}
            handle.write(json.dumps(header) + "\n")
            handle.flush()
        if finished:
            log.info("%s: going on after %d samples an earlier run measured", path, len(finished))
        return cls(path, handle, n_methods, finished)

    @staticmethod
    def _read(
        path: Path, text: str, target: str, settings: Mapping[str, Any], machine: Mapping[str, Any]
    ) -> tuple[dict[str, SampleRecords], int]:
        """The journaled samples, and the byte length of the file's complete, readable lines."""
        lines = text.splitlines(keepends=True)
        if not lines or not lines[0].endswith("\n"):
            return {}, 0
        try:
            header = json.loads(lines[0])
            # journals begun before the machine was recorded are taken as this machine's
            previous = BenchResults(header.get("machine", machine), header["target"], header["settings"])
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ConfigError(
                f"{path} is not a jetflow sample journal ({error}); remove it to start anew"
            ) from None
        check_compatible(previous, BenchResults(dict(machine), target, dict(settings)))
        moved = [key for key in SAME_MACHINE_KEYS if previous.machine.get(key) != machine.get(key)]
        if moved:
            shown = ", ".join(
                f"{key} ({previous.machine.get(key)!r} -> {machine.get(key)!r})" for key in moved
            )
            raise ConfigError(f"{path} was measured on another machine: {shown}; remove it to start anew")
        n_methods = len(settings["methods"])
        finished: dict[str, SampleRecords] = {}
        kept = len(lines[0].encode())
        for number, line in enumerate(lines[1:], start=2):
            if not line.endswith("\n"):
                break  # only the last line can be cut off (a killed process): its sample runs again
            try:
                data = json.loads(line)
                finished[data["sample_id"]] = _sample_from_json(data, n_methods)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
                raise ConfigError(
                    f"{path} line {number} is damaged ({error}); remove it to start anew"
                ) from None
            kept += len(line.encode())
        return finished, kept

    def append(self, sample_id: str, records: SampleRecords) -> None:
        """Journal a finished sample durably (flushed and synced before the next one starts)."""
        if len(records) != self._n_methods:
            raise ValueError(f"{len(records)} method records for {self._n_methods} methods")
        self._handle.write(json.dumps(_sample_json(sample_id, records)) + "\n")
        self._handle.flush()
        os.fsync(self._handle.fileno())

    def remove(self) -> None:
        """The data set's rows are saved: drop the journal (and its lock)."""
        self.path.unlink(missing_ok=True)
        self.close()

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> SampleJournal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def check_same_prompt(records: SampleRecords, prompt_ids: Sequence[int], path: Path) -> None:
    """Refuse journaled records of a sample whose first prompt is no longer the same (a data set
    or chat template changed between the processes)."""
    if records[0] and tuple(records[0][0].prompt_ids) != tuple(prompt_ids):
        raise ConfigError(
            f"{path}: sample {records[0][0].sample_id!r} was measured on another prompt; remove the journal"
        )
