"""The frozen target's linear layers through weights packed once for oneDNN (CPU, bfloat16).

``torch.nn.functional.linear`` on a CPU in bfloat16 hands oneDNN the weight in its plain
layout, and oneDNN reorders it into its blocked layout on every call: for the few rows of a
decoding step or a small tree that reorder, not the arithmetic, is most of the cost, and it
grows with the rows. The target's weights never change, so each is reordered once at load
(:func:`pack_linear_weights`) and every inference call runs the same oneDNN kernel on the
packed copy. The result is the same kernel on the same data, so the outputs are bit for bit
those of the plain forward (the tests check it); only the per-call reorder is gone.

Where the plain forward is needed the packed one steps aside: under autograd (a head trained
through the target's LM head), inside ``torch.compile`` (inductor packs weights itself), and in
:func:`unpacked` (a peer such as ``transformers.generate`` measured as users run it). Packing
costs a second copy of the linear weights in memory. It applies only where oneDNN runs
bfloat16 natively; ``JETFLOW_PACKED_WEIGHTS=0`` turns it off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

#: environment switch: ``0`` keeps every linear layer on the plain forward
ENV_SWITCH = "JETFLOW_PACKED_WEIGHTS"


class PackedLinear:
    """``x @ weight.T + bias`` on ``weight`` reordered once into oneDNN's blocked layout.

    Falls back to ``F.linear`` on the plain weight under autograd, inside ``torch.compile``
    and for an input of another dtype (whose error, if any, is then ``F.linear``'s own).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def __call__(self, x: Tensor) -> Tensor:
        if x.requires_grad or torch.compiler.is_compiling() or x.dtype != self.packed.dtype:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packing_unavailable(module_or_weight: nn.Module | Tensor) -> str | None:
    """Why these weights are not packed here, or None when they are."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    parameter: Tensor | None = (
        module_or_weight
        if isinstance(module_or_weight, Tensor)
        else next(module_or_weight.parameters(), None)
    )
    if parameter is None or parameter.device.type != "cpu":
        return "not on the CPU"
    if parameter.dtype != torch.bfloat16:
        return f"{parameter.dtype} (packing serves bfloat16)"
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return "oneDNN has no native bfloat16 on this processor"
    return None


def packed_or_plain(weight: Tensor, bias: Tensor | None = None) -> PackedLinear | None:
    """A :class:`PackedLinear` of ``weight`` where packing serves it, else None."""
    return PackedLinear(weight, bias) if packing_unavailable(weight) is None else None


def pack_linear_weights(model: nn.Module) -> int:
    """Give every ``nn.Linear`` of ``model`` a packed forward where :func:`packing_unavailable`
    finds nothing against it; returns how many layers were packed (0: none)."""
    reason = packing_unavailable(model)
    if reason is not None:
        log.debug("linear weights left plain: %s", reason)
        return 0
    layers = [module for module in model.modules() if type(module) is nn.Linear]
    for linear in layers:
        # an instance attribute shadows the class's forward: nn.Module.__call__ finds it first
        setattr(linear, "forward", PackedLinear(linear.weight, linear.bias))  # noqa: B010
    return len(layers)


def is_packed(linear: nn.Module) -> bool:
    return isinstance(linear.__dict__.get("forward"), PackedLinear)


@contextmanager
def unpacked(model: nn.Module) -> Iterator[None]:
    """``model`` on the plain forward for the duration (its packed copies kept for afterwards)."""
    packed = {module: module.__dict__.pop("forward") for module in model.modules() if is_packed(module)}
    try:
        yield
    finally:
        for module, forward in packed.items():
            module.forward = forward
