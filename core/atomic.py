"""Atomic replacement of a file or a folder, so an interrupted writer never leaves a torn one.

Every writer of lasting state (a checkpoint, a calibration record, an export folder, a
corpus shard, a cache) writes to a staging sibling, flushes it to disk, then renames it
over its final name: a reader, or a resumed run, sees the old complete copy or the new
complete copy, never half of one. A staging name is ``.<name>.tmp<pid>``: hidden, in the
same folder (so the rename never crosses file systems) and naming its writer, so that
:func:`remove_staging_files` can tell a killed writer's leftovers from a live one's.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: what a staging name adds after the final name (then the writer's process id)
_STAGING_MARK = ".tmp"
#: what marks the name an existing folder is moved to while its replacement takes its place
_RETIRED_MARK = ".retired"
#: shared read access: some writers (safetensors) create private files, and results are shared
_FILE_MODE = 0o644


def staging_path(path: Path, role: str = "") -> Path:
    """The hidden sibling of ``path`` this process stages under (``role`` tells two apart)."""
    return path.with_name(f".{path.name}{role}{_STAGING_MARK}{os.getpid()}")


@contextmanager
def atomic_path(path: Path, *, replace: bool = True) -> Iterator[Path]:
    """Yield a staging sibling of ``path``; on success it becomes ``path``, on failure it goes.

    The caller writes a single file at the staging path, or creates a folder there and fills
    it; either way nothing exists there beforehand. On a clean exit its files are flushed to
    disk and it is renamed over ``path``; an existing folder at ``path`` is replaced whole.
    With ``replace=False`` (a cache every writer fills identically) an existing ``path``
    wins and this copy is discarded. On an exception the staging copy is removed and
    ``path`` keeps its old content.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(path)
    _remove(staging)  # left by an earlier process that had this id
    try:
        yield staging
        if not os.path.lexists(staging):
            raise FileNotFoundError(f"nothing was written at {staging} to become {path}")
        _flush(staging)
        if replace:
            _rename_over(staging, path)
        elif not os.path.lexists(path):
            _rename_unless_present(staging, path)
    finally:
        _remove(staging)


def write_json_atomic(path: Path, payload: object, indent: int = 1) -> None:
    """Write ``payload`` as indented JSON (ending in a newline) through :func:`atomic_path`."""
    with atomic_path(path) as staging:
        staging.write_text(json.dumps(payload, indent=indent) + "\n", encoding="utf-8")


def remove_staging_files(folder: Path) -> int:
    """Delete the staging files and folders that killed writers left in ``folder``; returns how many.

    A staging name carries its writer's process id, so one of a live process (another writer
    of the same folder, as when feature extraction is split over processes) is left alone.
    """
    if not folder.is_dir():
        return 0
    stale = [path for path in folder.glob(f".*{_STAGING_MARK}*") if not _writer_alive(path)]
    for path in stale:
        _remove(path)
    return len(stale)


def _flush(staging: Path) -> None:
    """Put the staged data on disk (before a rename makes it visible) and make it readable to all."""
    files = [staging] if not staging.is_dir() else [p for p in staging.rglob("*") if p.is_file()]
    for file in files:
        with open(file, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(file, _FILE_MODE)


def _rename_over(staging: Path, path: Path) -> None:
    """Rename ``staging`` to ``path``; an existing folder there is moved aside first, then removed.

    POSIX renames a file over a file atomically but not a folder over a non-empty folder, so
    the old folder is retired under a staging name of its own: if the second rename fails
    the old folder is put back, and a killed process leaves it for :func:`remove_staging_files`.
    """
    if not path.is_dir() or path.is_symlink():
        os.replace(staging, path)
        return
    retired = staging_path(path, role=_RETIRED_MARK)
    _remove(retired)
    os.replace(path, retired)
    try:
        os.replace(staging, path)
    except OSError:
        os.replace(retired, path)
        raise
    _remove(retired)


def _rename_unless_present(staging: Path, path: Path) -> None:
    """Rename ``staging`` to ``path``, unless another writer's copy got there first (it stays)."""
    try:
        os.replace(staging, path)
    except OSError:  # a folder is not renamed over a non-empty folder
        if not path.exists():
            raise


def _remove(path: Path) -> None:
    """Remove a file or a folder tree at ``path``, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _writer_alive(staging: Path) -> bool:
    """True when the process named by a staging name's ``.tmp<pid>`` suffix is running."""
    pid = staging.name.rpartition(_STAGING_MARK)[2]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        pass
    return True
