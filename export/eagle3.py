"""An EAGLE head in the ``eagle3`` layout as vLLM's Eagle3 draft model.

The two compute the same thing once the names are mapped (read from vLLM 0.32's
``llama_eagle3.py`` and ``qwen3_eagle3.py``): vLLM's ``fc`` is the head's feature projection
(the target layers' outputs concatenated in increasing layer order, no norm before it);
its layer 0 norms the token embedding with ``input_layernorm`` (the head's ``embed_norm``)
and the state with ``hidden_norm``, feeds their 2H concatenation to q/k/v, adds attention
and MLP to the residual ``hidden_norm(state)`` and ends in ``norm``, whose output meets the
LM head; the pre-norm output is the next draft step's state (:data:`EAGLE3_OPTIONS`, written
explicitly). The token embedding is the target's (vLLM shares it when the folder has none);
the LM head is the target's rows of the draft vocabulary with ``d2t``/``t2d``. The layer is
Llama's (no q/k norms) or Qwen3's (q/k norms) as the head's ``qk_norm`` says.
"""

from __future__ import annotations

import torch
from jetflow.core.target import Target
from jetflow.drafters.eagle.head import EAGLE3_OPTIONS, EagleHead
from jetflow.export.compat import NotExportableError, eagle3_differences
from jetflow.export.schema import (
    Eagle3Config,
    Eagle3LayerConfig,
    ProposalMethod,
    SpeculatorsExport,
    SpeculatorsSection,
    Verifier,
)
from jetflow.export.tensors import vllm_tensors

#: head parameter name -> vLLM Eagle3 tensor name (regex, replacement)
_NAMES: tuple[tuple[str, str], ...] = (
    (r"fusion\.proj\.weight", "fc.weight"),
    (r"embed_norm\.weight", "layers.0.input_layernorm.weight"),
    (r"layer\.hidden_norm\.weight", "layers.0.hidden_norm.weight"),
    (r"layer\.attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight", r"layers.0.self_attn.\1.weight"),
    (r"layer\.post_norm\.weight", "layers.0.post_attention_layernorm.weight"),
    (r"layer\.mlp\.(gate_proj|up_proj|down_proj)\.weight", r"layers.0.mlp.\1.weight"),
    (r"norm\.weight", "norm.weight"),
)


def export_eagle_head(
    head: EagleHead,
    target: Target,
    *,
    drafter: str,
    verifier: str,
    dtype: torch.dtype = torch.float32,
    provenance: dict | None = None,
) -> SpeculatorsExport:
    """The Eagle3 folder of ``head`` (loaded for ``target``); refuses a head in the jetflow layout."""
    differences = eagle3_differences(head.config.model_dump(), target.num_layers)
    if differences:
        raise NotExportableError(drafter, "eagle3", differences)
    c = head.config
    tensors, draft_vocab = vllm_tensors(
        head.state_dict(), _NAMES, target, drafter=drafter, fmt="eagle3", dtype=dtype
    )
    layer = Eagle3LayerConfig(
        model_type="qwen3" if c.qk_norm else "llama",
        **c.transformers_fields(),
        max_position_embeddings=target.context_length,
        vocab_size=target.vocab_size,
    )
    config = Eagle3Config(
        speculators_config=SpeculatorsSection(
            algorithm="eagle3",
            proposal_methods=(ProposalMethod(speculative_tokens=c.ttt_steps),),
            verifier=Verifier.of(target, verifier),
        ),
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab,
        target_hidden_size=target.hidden_size,
        eagle_aux_hidden_state_layer_ids=tuple(c.feature_layers),
        **EAGLE3_OPTIONS,
        jetflow={"drafter": drafter, **(provenance or {})},
    )
    return SpeculatorsExport(config, tensors)
