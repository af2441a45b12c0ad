"""A block head (JetFlow causal, DFlash bidirectional) as vLLM's DFlash draft model.

The two compute the same thing once the names are mapped (read from vLLM 0.32's
``qwen3_dflash.py``): vLLM's ``fc`` then ``hidden_norm`` are the head's feature fusion (the
target layers' outputs concatenated in layer order, projected, RMS-normed once); each draft
layer projects those fused context features with its own k/v projections (k normed, rotated
at the context positions) in front of the block's keys/values; the block is the anchor (the
last committed token) followed by mask slots at the next positions, under the in-block mask
``causal`` chooses; the final norm feeds the target's LM head, restricted to the draft
vocabulary by ``d2t`` (draft column -> target id offsets) when the head has one. The head's
learned mask embedding replaces the embedding of ``mask_token_id`` (vLLM reads it from
``mask_embedding.pt``), so the mask token is one the target never emits in a response.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from jetflow.core.errors import ConfigError
from jetflow.core.target import Target
from jetflow.drafters.block_head import BlockHead
from jetflow.export.compat import NotExportableError, dflash_differences
from jetflow.export.schema import (
    DFlashConfig,
    LayerConfig,
    ProposalMethod,
    SpeculatorsExport,
    SpeculatorsSection,
    Verifier,
)
from jetflow.export.tensors import vllm_tensors

#: head parameter name -> vLLM DFlash tensor name (regex, replacement)
_NAMES: tuple[tuple[str, str], ...] = (
    (r"fusion\.proj\.weight", "fc.weight"),
    (r"fusion\.norm\.weight", "hidden_norm.weight"),
    (r"norm\.weight", "norm.weight"),
    (
        r"layers\.(\d+)\.attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight",
        r"layers.\1.self_attn.\2.weight",
    ),
    (r"layers\.(\d+)\.input_norm\.weight", r"layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.post_norm\.weight", r"layers.\1.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight", r"layers.\1.mlp.\2.weight"),
)


def choose_mask_token(target: Target, avoid: Iterable[int]) -> int:
    """A token the target never emits in a response: an added (non-special) token first, then a
    special one; never an end-of-sequence or begin token, and outside ``avoid`` (the draft
    vocabulary) where such a token exists.

    vLLM swaps in the mask embedding wherever the drafter's input is this token, so an anchor
    equal to it would be drafted from the mask embedding instead (still lossless, but slower).
    """
    tokenizer = target.tokenizer
    special = set(tokenizer.all_special_ids)
    added = set(tokenizer.get_added_vocab().values()) - special
    excluded = set(target.eos_token_ids) | {tokenizer.bos_token_id}
    avoid = set(avoid)
    for group in (added - avoid, special - avoid, added, special):
        candidates = sorted(group - excluded)
        if candidates:
            return candidates[0]
    raise ConfigError("no unused special token can serve as the mask token; pass --mask-token-id")


def export_block_head(
    head: BlockHead,
    target: Target,
    *,
    drafter: str,
    verifier: str,
    mask_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
    provenance: dict | None = None,
) -> SpeculatorsExport:
    """The DFlash folder of ``head`` (a ``BlockHead`` loaded for ``target``); refuses an unfaithful one."""
    differences = dflash_differences(head.config.model_dump(), target.num_layers)
    if differences:
        raise NotExportableError(drafter, "dflash", differences)
    c = head.config
    state = head.state_dict()
    tensors, draft_vocab = vllm_tensors(
        state, _NAMES, target, drafter=drafter, fmt="dflash", dtype=dtype, skip={"mask_embedding"}
    )
    draft_tokens = state.get("draft_tokens")
    if mask_token_id is None:
        mask_token_id = choose_mask_token(target, [] if draft_tokens is None else draft_tokens.tolist())
    vocab = target.vocab_size
    layer = LayerConfig(
        **c.transformers_fields(),
        num_hidden_layers=c.num_layers,
        max_position_embeddings=target.context_length,
        vocab_size=vocab,
    )
    config = DFlashConfig(
        speculators_config=SpeculatorsSection(
            algorithm="dflash",
            proposal_methods=(ProposalMethod(speculative_tokens=c.block_size - 1),),
            verifier=Verifier.of(target, verifier),
        ),
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab,
        target_hidden_size=target.hidden_size,
        mask_token_id=mask_token_id,
        aux_hidden_state_layer_ids=tuple(c.feature_layers),
        sliding_window_non_causal=not c.causal,
        block_size=c.block_size,
        jetflow={"drafter": drafter, **(provenance or {})},
    )
    mask = state["mask_embedding"].detach().to(device="cpu", dtype=dtype).reshape(-1)
    return SpeculatorsExport(config, tensors, mask)
