"""Atomic file replacement, so an interrupted data job never leaves a half-written file.

Every corpus shard, feature shard and manifest is written to a temporary name in the same
folder, flushed to disk, then renamed over its final name: a reader (or a resumed run)
sees either the old complete file or the new complete file, never a torn one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write; rename it over ``path`` on success."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield staging
        with open(staging, "rb+") as handle:  # data on disk before the rename makes it visible
            os.fsync(handle.fileno())
        os.chmod(staging, 0o644)  # some writers (safetensors) create private files; data is shared
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def remove_staging_files(folder: Path) -> int:
    """Delete the temporaries that killed writers left in ``folder``; returns how many.

    A temporary names its writer's process id, so one of a live process (another writer of
    the same folder, as when feature extraction is split over processes) is left alone.
    """
    stale = [path for path in folder.glob(".*.tmp*") if not _writer_alive(path)] if folder.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def _writer_alive(staging: Path) -> bool:
    """True when the process named by a staging file's ``.tmp<pid>`` suffix is running."""
    pid = staging.name.rpartition(".tmp")[2]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        pass
    return True


def write_json_atomic(path: Path, payload: object) -> None:
    """Write ``payload`` as indented JSON through :func:`atomic_path`."""
    with atomic_path(path) as staging:
        staging.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
