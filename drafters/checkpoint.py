"""Drafter checkpoints: ``model.safetensors`` + ``config.json``, tied to the target they fit.

The JSON names the drafter, its architecture hyper-parameters, the target it was trained
for (architecture, layer count, hidden size, vocab size, tokenizer hash and the feature
layer ids), the training recipe and a summary of the data. The target's embedding and LM
head are never saved: a head does not own them. Loading onto a different target raises
:class:`CheckpointMismatchError` naming every field that differs; a missing or unreadable
file raises :class:`DataError`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jetflow.core.atomic import atomic_path
from jetflow.core.errors import CheckpointMismatchError, DataError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

if TYPE_CHECKING:
    from jetflow.core.target import Target

FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
#: target facts a checkpoint must agree with; the target's ``name`` is informative only
MATCHED_FIELDS = (
    "architecture",
    "num_layers",
    "hidden_size",
    "vocab_size",
    "tokenizer_hash",
    "feature_layers",
)


@dataclass(frozen=True)
class CheckpointInfo:
    """The JSON half of a checkpoint.

    Attributes:
        drafter: the drafter plugin name that reads these weights.
        architecture: the head's hyper-parameters (enough to rebuild it).
        target: the target fingerprint plus ``feature_layers`` (and its ``name``).
        recipe: how it was trained (the train config).
        data: what it was trained on (the data manifest summary).
        state: training progress (step, metrics), informative.
    """

    drafter: str
    architecture: dict[str, Any]
    target: dict[str, Any]
    recipe: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT_VERSION, **asdict(self)}, indent=2, default=_jsonable)


def _jsonable(value: object) -> object:
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {value!r}")


def target_record(target: Target, feature_layers: tuple[int, ...]) -> dict[str, Any]:
    """What a checkpoint records about its target: fingerprint + layer ids + name."""
    return {"name": target.name, **target.fingerprint(), "feature_layers": list(feature_layers)}


def save_checkpoint(
    folder: str | Path,
    weights: nn.Module | dict[str, Tensor],
    info: CheckpointInfo,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``weights`` (cast to ``dtype`` if given, e.g. fp16 for shipping) and ``info``.

    Each file is written beside its final name and renamed into place, config last, so a
    folder with a ``config.json`` always holds a complete checkpoint.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = weights.state_dict() if isinstance(weights, nn.Module) else weights
    tensors = {
        name: (t.detach().to(dtype) if dtype is not None and t.is_floating_point() else t.detach())
        .contiguous()
        .cpu()
        for name, t in state.items()
    }
    with atomic_path(folder / WEIGHTS_FILE) as staging:
        save_file(tensors, str(staging))
    with atomic_path(folder / CONFIG_FILE) as staging:
        staging.write_text(info.to_json())
    return folder


def read_checkpoint(folder: str | Path) -> tuple[CheckpointInfo, dict[str, Tensor]]:
    """Read a checkpoint without checking it against any target."""
    folder = Path(folder)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise DataError(f"checkpoint {folder} is incomplete: {path.name} not found")
    try:
        raw = json.loads(config_path.read_text())
        version = raw.pop("format")
        info = CheckpointInfo(**raw)
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise DataError(f"checkpoint config {config_path} is malformed: {error}") from None
    if version != FORMAT_VERSION:
        raise DataError(f"checkpoint {folder} has format {version}; this jetflow reads {FORMAT_VERSION}")
    try:
        state = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as error:
        raise DataError(f"checkpoint weights {weights_path} are unreadable: {error}") from None
    return info, state


def check_target(
    info: CheckpointInfo,
    target: Target,
    source: str | Path = "checkpoint",
    drafter: str | None = None,
    feature_layers: tuple[int, ...] | None = None,
) -> None:
    """Raise :class:`CheckpointMismatchError` naming every way ``info`` does not fit ``target``.

    ``feature_layers``, when given, are the layers the caller will feed (e.g. a feature
    cache's); otherwise the checkpoint's own layers are only checked against the depth.
    """
    if drafter is not None and info.drafter != drafter:
        raise CheckpointMismatchError(f"{source} holds a {info.drafter!r} head, not a {drafter!r} head")
    expected = target_record(target, tuple(feature_layers or info.target.get("feature_layers", ())))
    differences = [
        f"{name}: checkpoint {info.target.get(name)!r}, target {expected[name]!r}"
        for name in MATCHED_FIELDS
        if _normalise(info.target.get(name)) != _normalise(expected[name])
    ]
    layers = info.target.get("feature_layers") or []
    out_of_range = [layer for layer in layers if not 1 <= layer <= target.num_layers]
    if out_of_range and not differences:
        differences.append(
            f"feature_layers {out_of_range} do not exist in a {target.num_layers}-layer target"
        )
    if differences:
        trained_for = info.target.get("name", "unknown")
        raise CheckpointMismatchError(
            f"{source} does not fit target {target.name!r} (it was trained for {trained_for!r}): "
            + "; ".join(differences)
        )


def _normalise(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def load_checkpoint(
    folder: str | Path,
    target: Target,
    drafter: str | None = None,
    feature_layers: tuple[int, ...] | None = None,
) -> tuple[CheckpointInfo, dict[str, Tensor]]:
    """Read a checkpoint and verify it fits ``target`` (and ``drafter``, ``feature_layers``)."""
    info, state = read_checkpoint(folder)
    check_target(info, target, source=f"checkpoint {folder}", drafter=drafter, feature_layers=feature_layers)
    return info, state


def load_weights(module: nn.Module, state: dict[str, Tensor], source: str | Path) -> None:
    """``module.load_state_dict(state)`` with a clear error when the tensors do not fit."""
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as error:
        detail = " ".join(str(error).split())[:400]
        raise DataError(f"checkpoint {source} does not match its own architecture: {detail}") from None
