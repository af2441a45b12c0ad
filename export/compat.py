"""Can a head be served by vLLM as the very model it is? What differs, named, when it cannot.

An export must compute what the head computes; a head with a part vLLM's model class lacks
is refused with the list of differences, never written as a silently different model.
Every field of a head's architecture record is accounted for: either it maps onto the
vLLM class, it must hold the value the class hard-codes, or it only shapes training.
A field this module does not know (a head grown since) is a difference too.

Block heads map onto vLLM's DFlash model unless they use anchored slots or context tokens;
an EAGLE head maps onto vLLM's Eagle3 model in the ``eagle3`` layout only (trained with
``--set head.layout=eagle3``), never in the ``jetflow`` layout the shipped EAGLE head has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def dflash_differences(architecture: Mapping[str, Any], target_layers: int | None = None) -> list[str]:
    """What a block head (JetFlow / DFlash) has that vLLM's DFlash model lacks; empty: faithful.

    ``target_layers`` (the target's depth), when given, also checks the fused layers.
    """
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
    return differences + aux_layer_differences(architecture.get("feature_layers", ()), target_layers)


def aux_layer_differences(layers: Sequence[int], target_layers: int | None) -> list[str]:
    """Where vLLM's aux hidden states would not be the head's features.

    Both number layers alike (``hidden_states[i]``, the output of decoder layer ``i``), but
    vLLM collects them in increasing layer order and always before the final norm, while
    transformers' last hidden state (the one jetflow's features would hold) is after it.
    """
    differences = []
    if list(layers) != sorted(set(layers)):
        differences.append(
            f"feature_layers {list(layers)} are not increasing, but vLLM concatenates the target's "
            "states for fc in increasing layer order"
        )
    if target_layers is not None and target_layers in layers:
        differences.append(
            f"feature layer {target_layers} is the target's last: its transformers hidden state is "
            "after the final norm, vLLM's aux hidden state before it"
        )
    return differences


def _unknown(name: str, value: Any) -> str:
    return f"architecture field {name}={value!r} has no counterpart known to the exporter"


#: EAGLE head fields that map onto vLLM's Eagle3 model: sizes, layer ids, the draft vocabulary,
#: and qk_norm, which picks the class (Qwen3's Eagle3 layer norms q and k, Llama's does not)
_EAGLE3_MAPPED = frozenset(
    {
        "hidden_size",
        "feature_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "rope_theta",
        "rms_norm_eps",
        "qk_norm",
        "draft_vocab_size",
    }
)
#: the structure of jetflow's EAGLE layout that vLLM's Eagle3 classes (Llama and Qwen3) do not share
EAGLE3_DIFFERENCES = (
    "layout=jetflow: in_proj projects [norm(token embedding) ; state] (2H) down to H and the decoder "
    "layer attends over that (input norm, then q/k/v from H, residual = the projection), while "
    "vLLM's Eagle3 layer feeds the 2H concatenation straight into q/k/v with residual = the state",
    "layout=jetflow: the state of a drafted token is the head's normed output taken as it is, while "
    "vLLM passes the layer output (pre-norm, or normed with norm_output) through hidden_norm again "
    "(train with --set head.layout=eagle3 for a head in vLLM's layout)",
)


def eagle3_differences(architecture: Mapping[str, Any], target_layers: int | None = None) -> list[str]:
    """What an EAGLE head has that vLLM's Eagle3 model lacks; empty: faithful (the eagle3 layout).

    A record without ``layout`` predates the field: the jetflow layout.
    """
    differences = [] if architecture.get("layout", "jetflow") == "eagle3" else list(EAGLE3_DIFFERENCES)
    for name, value in architecture.items():
        if name not in _EAGLE3_MAPPED and name not in _TRAINING_ONLY and name != "layout":
            differences.append(_unknown(name, value))
    return differences + aux_layer_differences(architecture.get("feature_layers", ()), target_layers)
