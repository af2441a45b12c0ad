"""The calibration cache: one JSON file per key under ``cache_root()/calibration``, and the
calibration an engine starts from when it asks for ``auto`` or names no budget."""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path
from typing import Literal

from jetflow.core.atomic import atomic_path
from jetflow.core.cache_root import cache_root
from jetflow.core.calibration_record import SCHEMA_VERSION, Calibration, CalibrationKey
from jetflow.core.errors import ConfigError
from jetflow.core.model_files import DEFAULT_TARGET
from pydantic import ValidationError

log = logging.getLogger(__name__)


def calibration_path(key: CalibrationKey) -> Path:
    return cache_root() / "calibration" / f"{key.digest()}.json"


def load_calibration(key: CalibrationKey) -> Calibration | None:
    """The cached calibration for ``key``; None if there is none.

    Raises :class:`ConfigError` (one line) if the file exists but cannot be used: a stale
    schema, a record for another key, or a corrupt file.
    """
    path = calibration_path(key)
    if not path.is_file():
        return None
    try:
        return _read_record(path, key)
    except _UnusableRecord as problem:
        raise ConfigError(
            f"the cached calibration {problem}; rerun `jetflow calibrate --force` ({path})"
        ) from None


class _UnusableRecord(Exception):
    """Why a calibration file cannot be used (completed into a ConfigError by the caller)."""


def _read_record(path: Path, key: CalibrationKey) -> Calibration:
    """The calibration record at ``path``, checked to be of this schema and for ``key``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise _UnusableRecord(f"is unreadable ({type(error).__name__})") from None
    if not isinstance(data, dict) or data.get("version") != SCHEMA_VERSION:
        found = data.get("version") if isinstance(data, dict) else None
        raise _UnusableRecord(f"has schema version {found!r}, not {SCHEMA_VERSION}")
    try:
        calibration = Calibration.model_validate(data)
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        raise _UnusableRecord(f"is invalid at {where}: {problem['msg']}") from None
    if calibration.key != key:
        raise _UnusableRecord("was measured for another setup")
    return calibration


def save_calibration(calibration: Calibration) -> Path:
    """Write atomically, so a concurrent reader sees the old file or the new one, never half."""
    path = calibration_path(calibration.key)
    with atomic_path(path) as staging:
        staging.write_text(calibration.model_dump_json(indent=1), encoding="utf-8")
    return path


def install_calibration(path: Path, key: CalibrationKey) -> Calibration:
    """Make the calibration record at ``path`` (one kept beside results) the cached one for ``key``.

    Raises :class:`ConfigError` where the file is not a usable record for ``key``.
    """
    try:
        calibration = _read_record(path, key)
    except _UnusableRecord as problem:
        raise ConfigError(f"{path} is not a usable calibration record: it {problem}") from None
    save_calibration(calibration)
    return calibration


def compiling_pays(key: CalibrationKey) -> bool:
    """Whether ``key``'s setup is calibrated through the compiled target and predicts more
    tokens/s there than through the eager forward (or has no eager calibration to compare).

    Compiling costs minutes per tree-size bucket, so it is never started on a guess: only a
    calibration the user asked for (``jetflow calibrate --compile``) can make it the default.
    """
    compiled = _usable(key.model_copy(update={"compiled": True}))
    if compiled is None:
        return False
    eager = _usable(key.model_copy(update={"compiled": False}))
    return eager is None or _best_speed(compiled) > _best_speed(eager)


def _usable(key: CalibrationKey) -> Calibration | None:
    try:
        return load_calibration(key)
    except ConfigError as error:
        log.warning("ignoring the cached calibration: %s", error)
        return None


def _best_speed(calibration: Calibration) -> float:
    return max(point.expected_tokens_per_s for point in calibration.points)


#: "adaptive": calibrated, then re-chosen every step (:mod:`jetflow.core.adaptive`)
BudgetSource = Literal["fixed", "calibrated", "adaptive", "default"]


def cached_calibration(
    key: CalibrationKey, requested: int | str | None, target_spec: str = DEFAULT_TARGET
) -> Calibration | None:
    """The cached calibration an engine of ``key`` starts from when its budget is ``requested``.

    None for a fixed budget. Unset finds nothing (usable) without complaint, so a first run never
    stops to measure and starts at the default budget; ``auto`` is an explicit request and fails
    with what to run (``target_spec`` is the target as the user named it, for that command).
    """
    if isinstance(requested, int):
        return None
    calibration = load_calibration(key) if requested == "auto" else _usable(key)
    if calibration is None and requested == "auto":
        raise ConfigError(
            f"--budget auto needs a calibration and there is none for {key.describe()}; "
            f"run `{calibrate_command(key, target_spec)}` first (or pass a fixed --budget)"
        )
    return calibration


def calibrate_command(key: CalibrationKey, target_spec: str = DEFAULT_TARGET) -> str:
    """The command that measures ``key`` (for the message when it is missing)."""
    words = ["jetflow", "calibrate", "--drafter", key.drafter, "--tree-policy", key.policy]
    if target_spec != DEFAULT_TARGET:
        words += ["--target", target_spec]
    words += ["--dtype", key.dtype, "--threads", str(key.machine.torch_threads)]
    return shlex.join(words)
