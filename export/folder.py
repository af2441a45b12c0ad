"""Writing and reading an export folder; a written folder is read back and checked before it counts."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from jetflow.core.atomic import atomic_path
from jetflow.core.errors import ConfigError, DataError
from jetflow.export.schema import (
    CONFIG_JSON,
    MASK_EMBEDDING,
    SPECULATORS_CONFIG,
    WEIGHTS,
    DFlashConfig,
    Eagle3Config,
    SpeculatorsExport,
)
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from torch import Tensor


def check_tensors(config: DFlashConfig | Eagle3Config, tensors: dict[str, Tensor]) -> None:
    """The tensors are exactly those vLLM's model loads for ``config``, in its shapes (clear error if not)."""
    expected = config.expected_tensors()
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise DataError(
            f"export tensors do not match the {config.speculators_model_type} layout: "
            f"missing {missing}, unexpected {extra}"
        )
    wrong = [
        f"{n} {tuple(t.shape)} != {expected[n]}" for n, t in tensors.items() if tuple(t.shape) != expected[n]
    ]
    if wrong:
        raise DataError("export tensors have the wrong shapes: " + "; ".join(wrong))
    if config.own_lm_head:
        vocab = config.transformer_layer_config.vocab_size
        targets = torch.arange(config.draft_vocab_size) + tensors["d2t"]
        if (
            int(targets.min()) < 0
            or int(targets.max()) >= vocab
            or targets.unique().numel() != targets.numel()
        ):
            raise DataError("d2t does not map the draft vocabulary onto distinct target tokens")
        if not torch.equal(tensors["t2d"].nonzero().flatten(), targets.sort().values):
            raise DataError("t2d does not mark exactly the draft vocabulary")


def write_export(export: SpeculatorsExport, out: str | Path) -> Path:
    """Write ``export`` into ``out`` atomically, read back and checked first; an old export is replaced."""
    out = Path(out)
    if out.exists() and not (out / CONFIG_JSON).is_file():
        raise ConfigError(f"{out} exists and is not an export folder; choose a new --out")
    check_tensors(export.config, export.tensors)
    with atomic_path(out) as staging:
        staging.mkdir()
        (staging / CONFIG_JSON).write_text(json.dumps(export.config.model_dump(mode="json"), indent=2) + "\n")
        save_file(export.tensors, str(staging / WEIGHTS), metadata={"format": "pt"})
        if isinstance(export.config, DFlashConfig):
            mask = {"mask_token_id": export.config.mask_token_id, "embedding": export.mask_embedding}
            torch.save(mask, staging / MASK_EMBEDDING)
        read_export(staging)  # read back before it replaces anything
    return out


def read_export(folder: str | Path) -> tuple[DFlashConfig | Eagle3Config, dict[str, Tensor], Tensor | None]:
    """A folder's config, tensors and mask embedding (DFlash; None for Eagle3), checked against the format."""
    folder = Path(folder)
    try:
        config = SPECULATORS_CONFIG.validate_json((folder / CONFIG_JSON).read_text())
        tensors = load_file(str(folder / WEIGHTS))
    except FileNotFoundError as error:
        raise _incomplete(folder, error) from None
    except ValidationError as error:
        problem = error.errors()[0]
        raise DataError(
            f"{folder / CONFIG_JSON}: {'.'.join(map(str, problem['loc']))}: {problem['msg']}"
        ) from None
    check_tensors(config, tensors)
    if isinstance(config, DFlashConfig):
        return config, tensors, _mask_embedding(folder, config)
    return config, tensors, None


def _mask_embedding(folder: Path, config: DFlashConfig) -> Tensor:
    """A DFlash folder's learned mask embedding ``[H]``, checked to stand for the config's mask token."""
    try:
        mask = torch.load(folder / MASK_EMBEDDING, weights_only=True)
    except FileNotFoundError as error:
        raise _incomplete(folder, error) from None
    if mask.get("mask_token_id") != config.mask_token_id:
        raise DataError(f"{MASK_EMBEDDING} names another mask token than config.json")
    return mask["embedding"]


def _incomplete(folder: Path, error: FileNotFoundError) -> DataError:
    return DataError(f"{folder} is not a complete export: {error.filename} is missing")
