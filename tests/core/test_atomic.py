"""The one atomic-write helper: a file or a whole folder is replaced complete, or not at all."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
from jetflow.core.atomic import atomic_path, remove_staging_files, write_json_atomic


class _WriterFailed(Exception):
    pass


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_file_appears_complete_and_readable_to_all(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "record.bin"
    with atomic_path(path) as staging:
        assert staging.parent == path.parent and not staging.exists()
        staging.write_bytes(b"new")
        staging.chmod(0o600)  # as safetensors leaves its files
        assert not path.exists(), "nothing is visible before the writer finishes"
    assert path.read_bytes() == b"new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert _hidden(path.parent) == []


def test_a_folder_replaces_an_existing_folder_whole(tmp_path: Path) -> None:
    out = tmp_path / "export"
    out.mkdir()
    (out / "old.json").write_text("old")
    with atomic_path(out) as staging:
        staging.mkdir()
        (staging / "config.json").write_text("new")
        (staging / "sub").mkdir()
        (staging / "sub" / "weights.bin").write_bytes(b"w")
        assert (out / "old.json").is_file(), "the old folder stays until the new one is complete"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "sub"]
    assert (out / "sub" / "weights.bin").read_bytes() == b"w"
    assert _hidden(tmp_path) == [], "neither the staging nor the retired folder is left"


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_failed_writer_leaves_the_old_content_and_no_staging(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "target"
    if kind == "file":
        path.write_text("old")
    else:
        path.mkdir()
        (path / "kept.txt").write_text("old")
    with pytest.raises(_WriterFailed), atomic_path(path) as staging:
        if kind == "file":
            staging.write_text("half")
        else:
            staging.mkdir()
            (staging / "kept.txt").write_text("half")
        raise _WriterFailed
    assert (path if kind == "file" else path / "kept.txt").read_text() == "old"
    assert _hidden(tmp_path) == []


def test_a_writer_that_wrote_nothing_is_an_error_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    path.write_text("old")
    with pytest.raises(FileNotFoundError, match="nothing was written"), atomic_path(path):
        pass
    assert path.read_text() == "old"


def test_without_replace_an_existing_copy_wins(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "data").write_text("first writer's")
    with atomic_path(cache, replace=False) as staging:
        staging.mkdir()
        (staging / "data").write_text("second writer's")
    assert (cache / "data").read_text() == "first writer's"
    assert _hidden(tmp_path) == []
    fresh = tmp_path / "fresh"
    with atomic_path(fresh, replace=False) as staging:
        staging.mkdir()
        (staging / "data").write_text("only writer's")
    assert (fresh / "data").read_text() == "only writer's"


def test_write_json_atomic(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    write_json_atomic(path, {"shards": [1, 2]})
    assert json.loads(path.read_text()) == {"shards": [1, 2]}
    assert path.read_text().endswith("\n")


def _dead_pid() -> int:
    """The id of a process that has exited (so a staging name carrying it is stale)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_remove_staging_files_takes_only_dead_writers_leftovers(tmp_path: Path) -> None:
    dead = _dead_pid()
    live_file = tmp_path / f".a.npy.tmp{os.getppid()}"
    dead_file = tmp_path / f".b.npy.tmp{dead}"
    dead_folder = tmp_path / f".export.retired.tmp{dead}"
    live_file.write_bytes(b"another writer's")
    dead_file.write_bytes(b"torn")
    dead_folder.mkdir()
    (dead_folder / "config.json").write_text("{}")
    (tmp_path / "kept.npy").write_bytes(b"complete")
    assert remove_staging_files(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live_file.name, "kept.npy"])
    assert remove_staging_files(tmp_path / "absent") == 0
