"""Can a head be served by vLLM as the very model it is? What differs, named, when it cannot.

An export must compute what the head computes; a head with a part vLLM's model class lacks
is refused with the list of differences, never written as a silently different model.
Every field of a head's architecture record is accounted for: either it maps onto the
vLLM class, it must hold the value the class hard-codes, or it only shapes training.
A field this module does not know (a head grown since) is a difference too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jetflow.core.errors import JetflowError


class NotExportableError(JetflowError):
    """A head whose architecture vLLM's model class cannot reproduce."""

    def __init__(self, drafter: str, fmt: str, differences: list[str]) -> None:
        self.differences = differences
        super().__init__(
            f"the {drafter} head cannot be exported faithfully as {fmt}: " + "; ".join(differences)
        )


#: block-head fields that map onto vLLM's DFlash model (sizes, layer ids, the in-block mask)
_DFLASH_MAPPED = frozenset(
    {
        "hidden_size",
        "feature_layers",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "block_size",
        "causal",
        "rope_theta",
        "rms_norm_eps",
        "draft_vocab_size",
    }
)
#: fields that change how a head is trained, not what its forward computes
_TRAINING_ONLY = frozenset({"path_conditioning", "ttt_steps", "init_from_target"})
#: fields vLLM's DFlash model hard-codes: (the value it has, what it does instead otherwise)
_DFLASH_FIXED: dict[str, tuple[object, str]] = {
    "qk_norm": (True, "qk_norm=false, but vLLM's DFlash layer always RMS-norms q and k per head"),
    "anchored_slots": (
        False,
        "anchored_slots=true (a learned embedding per depth plus slot_proj of [anchor embedding ; "
        "last context feature] in every mask slot), but vLLM's DFlash feeds every mask slot the one "
        "embedding of mask_token_id",
    ),
    "context_tokens": (
        False,
        "context_tokens=true (every context entry also holds the embedding of the token after it), but "
        "vLLM's DFlash context is the fused target features alone",
    ),
}


def dflash_differences(architecture: Mapping[str, Any]) -> list[str]:
    """What a block head (JetFlow / DFlash) has that vLLM's DFlash model lacks; empty: faithful."""
    differences = []
    for name, value in architecture.items():
        if name in _DFLASH_MAPPED or name in _TRAINING_ONLY:
            continue
        if name in _DFLASH_FIXED:
            required, problem = _DFLASH_FIXED[name]
            if value != required:
                differences.append(problem)
            continue
        differences.append(_unknown(name, value))
    return differences


def _unknown(name: str, value: Any) -> str:
    return f"architecture field {name}={value!r} has no counterpart known to the exporter"


#: the structure of jetflow's EAGLE head that vLLM's Eagle3 classes (Llama and Qwen3) do not share
EAGLE3_DIFFERENCES = (
    "in_proj: the head projects [norm(token embedding) ; state] (2H) down to H and its decoder "
    "layer attends over that (input norm, then q/k/v from H, residual = the projection), while "
    "vLLM's Eagle3 layer feeds the 2H concatenation straight into q/k/v with residual = the state",
    "the state of a drafted token is the head's normed output taken as it is, while vLLM passes "
    "the layer output (pre-norm, or normed with norm_output) through hidden_norm again",
)


def eagle3_differences(architecture: Mapping[str, Any]) -> list[str]:
    """What jetflow's EAGLE head has that vLLM's Eagle3 model lacks (its layout, always)."""
    known = _DFLASH_MAPPED | _TRAINING_ONLY | {"qk_norm"}
    unknown = [_unknown(name, value) for name, value in architecture.items() if name not in known]
    return [*EAGLE3_DIFFERENCES, *unknown]
