"""Which attention a target's verify forward runs, and the mask that forward is handed.

On CUDA, with Triton installed and a model of plain full attention (no sliding window, no
softcapping), the target's model is switched once, at load time, to the attention function
registered here under :data:`IMPLEMENTATION` through transformers' ``AttentionInterface``. That
function runs the Triton tree kernel when it is handed the compact int32 tree mask
(:mod:`jetflow.attention.tree_mask`) and transformers' own SDPA function for anything else, so
prefill and one-node (plain) steps keep SDPA exactly as before. Everywhere else (CPU, no
Triton, another attention implementation chosen by the user) nothing changes and verify passes
the dense additive mask to SDPA. ``JETFLOW_TREE_ATTENTION=0`` keeps SDPA on CUDA too.

Nothing here imports Triton unless the kernel is chosen, so a CPU install never needs it.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch
from jetflow.attention.tree_mask import dense_visibility, tree_mask
from torch import Tensor
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

log = logging.getLogger(__name__)

#: the name registered in transformers' attention interfaces
IMPLEMENTATION = "jetflow_tree"
#: what stats report for the kernel path; otherwise the model's own implementation (``sdpa``)
TRITON_TREE = "triton-tree"
SDPA = "sdpa"


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why the tree kernel cannot replace this model's attention, or None when it can."""
    config = model.config
    if config._attn_implementation != SDPA:
        return f"the model uses {config._attn_implementation!r} attention, not sdpa"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        return "some layers use sliding-window attention"
    if (
        layer_types is None
        and getattr(config, "sliding_window", None)
        and getattr(config, "use_sliding_window", True)
    ):
        return "the model uses sliding-window attention"
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None):
        return "the model soft-caps its attention logits"
    return None


def select_verify_attention(model: PreTrainedModel) -> str:
    """Choose the verify forward's attention once per target: ``triton-tree`` or the model's own.

    Switches ``model`` to the tree kernel where it applies (CUDA, Triton installed, a plain
    full-attention sdpa model, not turned off by ``JETFLOW_TREE_ATTENTION=0``).
    """
    if model.device.type != "cuda" or os.environ.get("JETFLOW_TREE_ATTENTION", "1") == "0":
        return model.config._attn_implementation or SDPA
    if not triton_installed():
        log.info("verify attention: sdpa (triton is not installed)")
        return model.config._attn_implementation or SDPA
    reason = unsupported_reason(model)
    if reason is not None:
        log.info("verify attention: %s (%s)", model.config._attn_implementation, reason)
        return model.config._attn_implementation or SDPA
    return enable_tree_attention(model)


def enable_tree_attention(model: PreTrainedModel) -> str:
    """Register the tree attention and switch ``model`` to it on any device (the tests run it on
    CPU tensors in Triton's interpreter); returns ``triton-tree``."""
    AttentionInterface.register(IMPLEMENTATION, tree_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)  # prefill masks exactly as sdpa
    model.set_attn_implementation(IMPLEMENTATION)
    return TRITON_TREE


def tree_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: the tree kernel for a tree mask, else SDPA."""
    if attention_mask is None or attention_mask.dtype != torch.int32:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    extras = [
        name
        for name in ("softcap", "sliding_window", "position_bias", "s_aux")
        if kwargs.get(name) is not None
    ]
    if extras or dropout:
        raise ValueError(f"the tree attention kernel supports no {', '.join(extras) or 'dropout'}")
    from jetflow.attention.tree_attention import tree_attention

    return tree_attention(query, key, value, attention_mask, scale=scaling), None


def verify_mask(ancestor: Tensor, n_cached: int, attention: str, dtype: torch.dtype, device) -> Tensor:
    """The ``attention_mask`` of a verify forward of a tree with ``ancestor`` (``[n, n]`` bool).

    On the kernel path, a tree of more than one node gets the compact tree mask
    ``[1, 1, n, 1 + ceil(n / 32)]`` int32, built on ``device``; otherwise the dense additive
    mask ``[1, 1, n, n_cached + n]`` of ``dtype`` (0 where visible, the dtype's minimum elsewhere).
    """
    ancestor = ancestor.to(device, non_blocking=True)
    if attention == TRITON_TREE and ancestor.shape[0] > 1:
        return tree_mask(ancestor, n_cached)
    visible = dense_visibility(ancestor, n_cached)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[None, None]
