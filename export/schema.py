"""The ``speculators`` folder format as vLLM 0.32 reads it: the config fields and the tensors.

vLLM recognises a draft folder by ``speculators_config`` in its ``config.json``; it builds
the draft model's config from ``transformer_layer_config`` plus the algorithm's own
top-level fields (``vllm/transformers_utils/configs/speculators/algos.py``), and loads the
weights by the names of its model class (``vllm/model_executor/models/qwen3_dflash.py``).
These models state exactly that contract, so an export is validated before it is written
and a test can check a written folder against it without vLLM installed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

CONFIG_JSON = "config.json"
WEIGHTS = "model.safetensors"
#: vLLM's DFlash loader reads a learned mask embedding from this file (``{"mask_token_id", "embedding"}``)
MASK_EMBEDDING = "mask_embedding.pt"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProposalMethod(_Model):
    proposal_type: Literal["greedy"] = "greedy"
    speculative_tokens: int = Field(
        ge=1, description="drafted tokens per step (vLLM's num_speculative_tokens)"
    )


class Verifier(_Model):
    """The target the head was trained for: ``vllm serve FOLDER`` loads it as the model."""

    name_or_path: str = Field(min_length=1)
    architectures: tuple[str, ...] = Field(min_length=1)


class SpeculatorsSection(_Model):
    algorithm: Literal["dflash"]
    proposal_methods: tuple[ProposalMethod, ...] = Field(min_length=1)
    default_proposal_method: Literal["greedy"] = "greedy"
    verifier: Verifier


class LayerConfig(_Model):
    """``transformer_layer_config``: the draft decoder layers (a Qwen3 layer: q/k RMSNorm, SwiGLU)."""

    model_type: Literal["qwen3"] = "qwen3"
    hidden_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=2)
    intermediate_size: int = Field(ge=1)
    hidden_act: Literal["silu"] = "silu"
    rms_norm_eps: float = Field(gt=0)
    rope_parameters: dict[str, Any]
    max_position_embeddings: int = Field(ge=1)
    vocab_size: int = Field(ge=1, description="the target's vocabulary")
    attention_bias: Literal[False] = False
    tie_word_embeddings: Literal[False] = False


class DFlashConfig(_Model):
    """``config.json`` of a DFlash folder (``speculators_model_type = "dflash"``)."""

    speculators_model_type: Literal["dflash"] = "dflash"
    architectures: tuple[Literal["DFlashDraftModel"], ...] = ("DFlashDraftModel",)
    speculators_config: SpeculatorsSection
    transformer_layer_config: LayerConfig
    draft_vocab_size: int = Field(ge=1)
    target_hidden_size: int = Field(ge=1)
    mask_token_id: int = Field(ge=0)
    aux_hidden_state_layer_ids: tuple[int, ...] = Field(
        min_length=1, description="target layers whose outputs feed the head (hidden_states[i])"
    )
    sliding_window_non_causal: bool = Field(
        description="vLLM's name for a bidirectional block; false: the causal in-block mask (JetFlow)"
    )
    block_size: int = Field(ge=2, description="anchor + mask slots")
    jetflow: dict[str, Any] = Field(default_factory=dict, description="provenance: checkpoint, recipe")

    @model_validator(mode="after")
    def _consistent(self) -> DFlashConfig:
        layer = self.transformer_layer_config
        tokens = self.speculators_config.proposal_methods[0].speculative_tokens
        if tokens > self.block_size - 1:
            raise ValueError(f"speculative_tokens {tokens} exceeds the block's {self.block_size - 1} slots")
        if self.sliding_window_non_causal and tokens != self.block_size - 1:
            raise ValueError(
                "a bidirectional block sees all its slots: speculative_tokens must be block_size - 1"
            )
        if self.draft_vocab_size > layer.vocab_size:
            raise ValueError("draft_vocab_size exceeds the target's vocabulary")
        if not 0 <= self.mask_token_id < layer.vocab_size:
            raise ValueError("mask_token_id is outside the target's vocabulary")
        if layer.num_attention_heads % layer.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self

    @property
    def causal(self) -> bool:
        return not self.sliding_window_non_causal

    @property
    def own_lm_head(self) -> bool:
        """A draft vocabulary ships its LM-head rows and maps; the full one shares the target's."""
        return self.draft_vocab_size < self.transformer_layer_config.vocab_size

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor name vLLM's DFlash model loads from ``model.safetensors``, with its shape."""
        layer = self.transformer_layer_config
        hidden, d = layer.hidden_size, layer.head_dim
        q, kv, inter = layer.num_attention_heads * d, layer.num_key_value_heads * d, layer.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "fc.weight": (hidden, self.target_hidden_size * len(self.aux_hidden_state_layer_ids)),
            "hidden_norm.weight": (hidden,),
            "norm.weight": (hidden,),
        }
        for i in range(layer.num_hidden_layers):
            shapes |= {
                f"layers.{i}.self_attn.q_proj.weight": (q, hidden),
                f"layers.{i}.self_attn.k_proj.weight": (kv, hidden),
                f"layers.{i}.self_attn.v_proj.weight": (kv, hidden),
                f"layers.{i}.self_attn.o_proj.weight": (hidden, q),
                f"layers.{i}.self_attn.q_norm.weight": (d,),
                f"layers.{i}.self_attn.k_norm.weight": (d,),
                f"layers.{i}.input_layernorm.weight": (hidden,),
                f"layers.{i}.post_attention_layernorm.weight": (hidden,),
                f"layers.{i}.mlp.gate_proj.weight": (inter, hidden),
                f"layers.{i}.mlp.up_proj.weight": (inter, hidden),
                f"layers.{i}.mlp.down_proj.weight": (hidden, inter),
            }
        if self.own_lm_head:
            shapes |= {
                "lm_head.weight": (self.draft_vocab_size, hidden),
                "d2t": (self.draft_vocab_size,),
                "t2d": (layer.vocab_size,),
            }
        return shapes
