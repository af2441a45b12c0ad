"""The frozen target's linear layers through weights laid out once for the CPU's kernels.

**bfloat16.** ``torch.nn.functional.linear`` on a CPU in bfloat16 hands oneDNN the weight in its
plain layout, and oneDNN reorders it into its blocked layout on every call: for the few rows of a
decoding step or a small tree that reorder, not the arithmetic, is most of the cost, and it
grows with the rows. The target's weights never change, so each is reordered once at load
(:func:`pack_linear_weights`) and every inference call runs the same oneDNN kernel on the
packed copy. The result is the same kernel on the same data, so the outputs are bit for bit
those of the plain forward (the tests check it); only the per-call reorder is gone.

**float32** (a processor without native bf16). Decoding streams every weight once per step, so a
step's floor is the memory bandwidth. ``F.linear`` (MKL) reaches about half of it for one row
and degrades fast with a few rows. Two layouts do better, each for its own row count: one row
multiplies the weight stored transposed (``x @ W^T`` with ``W^T`` contiguous, a matrix-vector
product at nearly the bandwidth), and the rows of a tree or a prompt go through oneDNN's packed
kernel (a 5-row product of the MLP's 576x1536 weight in 0.36 ms against F.linear's 0.53). These
are other kernels than ``F.linear``'s, so fp32 outputs are exact per shape, not bitwise those of
the plain forward: the lossless checks classify a divergence as a rounding tie or a bug. Small
weights (under :data:`MIN_FLOAT32_BYTES`) stay plain: they sit in the cache, where oneDNN's fixed
cost per call outweighs what packing saves.

Where the plain forward is needed the packed one steps aside: under autograd (a head trained
through the target's LM head), inside ``torch.compile`` (inductor packs weights itself), and in
:func:`unpacked` (a peer such as ``transformers.generate`` measured as users run it). Packing
costs a second copy of the linear weights in memory (a third in fp32: the transposed one). It
applies to bfloat16 where oneDNN runs it natively and to float32 on every CPU;
``JETFLOW_PACKED_WEIGHTS=0`` turns it off.
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
#: float32 weights smaller than this stay plain: they are served from the cache, where the
#: plain kernel is as fast and oneDNN's fixed cost per call (~50 us) would dominate
MIN_FLOAT32_BYTES = 1 << 20


class PackedLinear:
    """``x @ weight.T + bias`` on ``weight`` reordered once into oneDNN's blocked layout.

    In float32 a single row multiplies a transposed copy of the weight instead (see the module
    docstring). Falls back to ``F.linear`` on the plain weight under autograd, inside
    ``torch.compile`` and for an input of another dtype (whose error, if any, is then
    ``F.linear``'s own).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None, transposed: Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        #: ``weight.T`` contiguous, for one-row products (float32 only); a caller that keeps one
        #: already (the drafters' LM head) passes it in rather than holding two
        self.transposed: Tensor | None = None
        if weight.dtype == torch.float32:
            self.transposed = weight.detach().t().contiguous() if transposed is None else transposed

    def __call__(self, x: Tensor) -> Tensor:
        if x.requires_grad or torch.compiler.is_compiling() or x.dtype != self.packed.dtype:
            return F.linear(x, self.weight, self.bias)
        if self.transposed is not None and x.numel() == x.shape[-1]:  # one row
            row = x.reshape(1, -1)
            out = row @ self.transposed if self.bias is None else torch.addmm(self.bias, row, self.transposed)
            return out.reshape(*x.shape[:-1], -1)
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
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    if parameter.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no native bfloat16 on this processor"
    if parameter.dtype not in (torch.bfloat16, torch.float32):
        return f"{parameter.dtype} (packing serves bfloat16 and float32)"
    return None


def _worth_packing(weight: Tensor) -> bool:
    """Whether this weight, on a setup :func:`packing_unavailable` accepts, is packed."""
    return weight.dtype != torch.float32 or weight.numel() * weight.element_size() >= MIN_FLOAT32_BYTES


def packed_or_plain(
    weight: Tensor, bias: Tensor | None = None, transposed: Tensor | None = None
) -> PackedLinear | None:
    """A :class:`PackedLinear` of ``weight`` where packing serves it, else None; ``transposed``:
    the caller's own contiguous ``weight.T``, reused for one-row products."""
    if packing_unavailable(weight) is None and _worth_packing(weight):
        return PackedLinear(weight, bias, transposed)
    return None


def pack_linear_weights(model: nn.Module) -> int:
    """Give every ``nn.Linear`` of ``model`` a packed forward where :func:`packing_unavailable`
    finds nothing against it; returns how many layers were packed (0: none)."""
    reason = packing_unavailable(model)
    if reason is not None:
        log.debug("linear weights left plain: %s", reason)
        return 0
    layers = [m for m in model.modules() if type(m) is nn.Linear and _worth_packing(m.weight)]
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
