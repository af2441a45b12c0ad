"""``export_drafter``: a drafter's trained head, read from its checkpoint, written for vLLM.

The head is read through the drafter plugin's own checkpoint lookup and target check (those
decoding uses), so what is exported is what jetflow measured. A block head (``jetflow``,
``dflash``) becomes a DFlash folder, an EAGLE head in the ``eagle3`` layout an Eagle3 folder;
the shipped EAGLE head's ``jetflow`` layout is one vLLM's Eagle3 class does not share and is
refused with the differences named.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, TypedDict, Unpack

import torch
from jetflow.core.errors import ConfigError
from jetflow.core.model_files import DEFAULT_TARGET, embedded_default_folder
from jetflow.core.registry import Registry, default_registry
from jetflow.core.target import Target
from jetflow.drafters.block_head import BlockHead
from jetflow.drafters.eagle.head import EagleHead
from jetflow.drafters.learned import LearnedDrafter
from jetflow.export.dflash import export_block_head
from jetflow.export.eagle3 import export_eagle_head
from jetflow.export.folder import write_export
from jetflow.export.schema import SpeculatorsExport

log = logging.getLogger(__name__)

FORMATS = ("speculators",)


def verifier_for(target_spec: str) -> str:
    """What vLLM loads as the target: the embedded folder, a local folder, or a hub id."""
    if target_spec == DEFAULT_TARGET:
        return str(embedded_default_folder())
    if target_spec.endswith(".gguf"):
        raise ConfigError("vLLM serves the target from a safetensors folder or hub id: pass --verifier")
    path = Path(target_spec)
    return str(path.resolve()) if path.exists() else target_spec


def build_export(
    drafter: str,
    target: Target,
    target_spec: str = DEFAULT_TARGET,
    *,
    params: dict[str, Any] | None = None,
    verifier: str | None = None,
    mask_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
    registry: Registry | None = None,
) -> SpeculatorsExport:
    """The export of ``drafter``'s head on ``target``, not yet written.

    ``params`` are the drafter's (``checkpoint``: the head to export; default the one shipped
    for ``target``). The head is read from its checkpoint as it was saved, checked against
    ``target``; no drafter is built around it.
    """
    registry = registry or default_registry()
    drafter_cls = registry.get("drafter", drafter)
    if not issubclass(drafter_cls, LearnedDrafter):
        raise ConfigError(f"drafter {drafter!r} has no trained head to export")
    checkpoint = drafter_cls.checkpoint_for(drafter_cls.Params.model_validate(params or {}), target)
    head, info = drafter_cls.load_head(checkpoint, target)
    provenance = {
        "checkpoint": str(checkpoint),
        "target": target.name,
        "chain_accept": info.state.get("chain_accept"),
    }
    verifier = verifier or verifier_for(target_spec)
    if isinstance(head, EagleHead):
        return export_eagle_head(
            head, target, drafter=drafter, verifier=verifier, dtype=dtype, provenance=provenance
        )
    if isinstance(head, BlockHead):
        return export_block_head(
            head,
            target,
            drafter=drafter,
            verifier=verifier,
            mask_token_id=mask_token_id,
            dtype=dtype,
            provenance=provenance,
        )
    raise ConfigError(f"drafter {drafter!r} has a {type(head).__name__}, which no vLLM format holds")


class ExportOptions(TypedDict, total=False):
    """:func:`build_export`'s keyword options, which :func:`export_drafter` passes on as they are."""

    params: dict[str, Any] | None
    verifier: str | None
    mask_token_id: int | None
    dtype: torch.dtype
    registry: Registry | None


def export_drafter(
    drafter: str,
    out: str | Path,
    target_spec: str = DEFAULT_TARGET,
    *,
    fmt: str = "speculators",
    **options: Unpack[ExportOptions],
) -> Path:
    """Load the target (fp32: the LM-head rows are copied exactly), export the head, write ``out``."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}; known formats: {', '.join(FORMATS)}")
    target = Target.load(target_spec, torch.float32, device="cpu")
    export = build_export(drafter, target, target_spec, **options)
    path = write_export(export, out)
    log.info("exported %s as %s to %s", drafter, export.config.speculators_model_type, path)
    return path
