"""Flags that several commands share, and the checks of their values."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from jetflow.core.errors import ConfigError


def add_compile_flag(parser: argparse.ArgumentParser) -> None:
    """``--compile`` / ``--no-compile``: the compiled target forward, on or off (default: the config's,
    whose default compiles where a calibration made with ``--compile`` shows it pays)."""
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="verify through the target compiled ahead of time, one package per tree-size bucket, "
        "built on first use (minutes, once per machine) and loaded by later runs (--no-compile: the "
        "eager forward; default: compiled where `jetflow calibrate --compile` measured that it pays)",
    )


def writable_folder(folder: str | Path, flag: str = "--out") -> Path:
    """``folder``, created with its parents if missing, once a file could be written in it.

    Commands check their output before any model loads, so a path under a file, under
    ``/proc`` or on a read-only disk costs one line, not a traceback after the work is done.
    """
    path = Path(folder).expanduser()
    if problem := _unwritable(path):
        raise ConfigError(f"{flag} {folder}: cannot create or write this folder ({problem})")
    return path


def new_output_path(output: str | Path, flag: str = "--out") -> Path:
    """``output``, a file or folder a command will write whole (replacing, not writing into it),
    once its parent folder exists and takes files (see :func:`writable_folder`)."""
    path = Path(output).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {output}: a file is in the way")
    if problem := _unwritable(path.parent):
        raise ConfigError(f"{flag} {output}: cannot create or write its folder {path.parent} ({problem})")
    return path


def _unwritable(folder: Path) -> str | None:
    """Why ``folder`` cannot be created (with its parents) or take a file; None where it can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        blocking = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        return f"{blocking} is a file" if blocking else f"{error.strerror}: {error.filename}"
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as error:
        return f"no file can be written there: {error.strerror}"
