"""What every export does with a head's tensors: vLLM's names, the draft vocabulary's rows and maps.

A head keeps its draft vocabulary as ``draft_tokens`` (target ids of its LM-head columns)
and borrows the target's LM head; vLLM's draft models instead own the LM-head rows of the
draft vocabulary and map a draft id ``i`` to the target id ``i + d2t[i]`` (``t2d`` marks the
target ids in the draft vocabulary). A full vocabulary ships none of these: vLLM shares
the target's LM head.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence

import torch
from jetflow.core.target import Target
from jetflow.drafters.blocks import FrozenTargetParts
from jetflow.export.compat import NotExportableError
from torch import Tensor

#: head parameter name -> vLLM tensor name, as (regex, replacement) pairs
NameMap = Sequence[tuple[str, str]]


def renamed(
    state: Mapping[str, Tensor], names: NameMap, *, drafter: str, fmt: str, skip: Collection[str] = ()
) -> dict[str, Tensor]:
    """``state`` under vLLM's names; a tensor without a counterpart is a named refusal, never dropped."""
    out = {}
    for name, tensor in state.items():
        if name in skip:
            continue
        for pattern, replacement in names:
            if re.fullmatch(pattern, name):
                out[re.sub(pattern, replacement, name)] = tensor
                break
        else:
            missing = f"tensor {name!r} has no counterpart in vLLM's {fmt} model"
            raise NotExportableError(drafter, fmt, [missing])
    return out


def vllm_tensors(
    state: Mapping[str, Tensor],
    names: NameMap,
    target: Target,
    *,
    drafter: str,
    fmt: str,
    dtype: torch.dtype,
    skip: Collection[str] = (),
) -> tuple[dict[str, Tensor], int]:
    """The folder's tensors (in ``dtype``, on the CPU) and its ``draft_vocab_size``.

    ``state["draft_tokens"]``, where present, selects the target's LM-head rows the head drafts
    over; they are copied exactly from the (fp32) target.
    """
    tensors = renamed(state, names, drafter=drafter, fmt=fmt, skip={*skip, "draft_tokens"})
    lm_head = FrozenTargetParts.from_target(target).lm_head
    if lm_head.bias is not None:
        raise NotExportableError(drafter, fmt, ["the target's LM head has a bias, vLLM's draft LM head none"])
    draft_tokens = state.get("draft_tokens")
    vocab = target.vocab_size
    if draft_tokens is not None:
        draft_tokens = draft_tokens.to(torch.long).cpu()
        if draft_tokens.unique().numel() != draft_tokens.numel():
            raise NotExportableError(drafter, fmt, ["the draft vocabulary lists a token twice"])
        if draft_tokens.numel() < vocab:
            lm = lm_head.weight.detach()
            tensors["lm_head.weight"] = lm[draft_tokens.to(lm.device)]
    tensors = {name: t.detach().to(device="cpu", dtype=dtype).contiguous() for name, t in tensors.items()}
    if draft_tokens is None or draft_tokens.numel() == vocab:
        return tensors, vocab
    tensors["d2t"] = draft_tokens - torch.arange(draft_tokens.numel())
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, draft_tokens, True)
    return tensors, int(draft_tokens.numel())
