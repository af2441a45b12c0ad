"""The ``speculators`` folder format as vLLM 0.32 reads it: the config fields and the tensors.

vLLM recognises a draft folder by ``speculators_config`` in its ``config.json``; it builds
the draft model's config from ``transformer_layer_config`` plus the algorithm's own
top-level fields (``vllm/transformers_utils/configs/speculators/algos.py``), and loads the
weights by the names of its model class (``qwen3_dflash.py`` for DFlash; ``llama_eagle3.py``
and ``qwen3_eagle3.py`` for Eagle3, chosen by the layer config's ``model_type``).
These models state exactly that contract, so an export is validated before it is written
and a test can check a written folder against it without vLLM installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator
from torch import Tensor

if TYPE_CHECKING:
    from jetflow.core.target import Target

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

    @classmethod
    def of(cls, target: Target, name_or_path: str) -> Verifier:
        """``target`` as vLLM loads it from ``name_or_path`` (its folder or hub id)."""
        architectures = target.config.architectures or (type(target.model).__name__,)
        return cls(name_or_path=name_or_path, architectures=tuple(architectures))


class SpeculatorsSection(_Model):
    algorithm: Literal["dflash", "eagle3"]
    proposal_methods: tuple[ProposalMethod, ...] = Field(min_length=1)
    default_proposal_method: Literal["greedy"] = "greedy"
    verifier: Verifier


class DraftLayerConfig(_Model):
    """``transformer_layer_config``: the draft decoder layers; each format narrows the family."""

    model_type: str
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


class LayerConfig(DraftLayerConfig):
    """A DFlash head's decoder layers: Qwen3 layers (q/k RMSNorm, SwiGLU)."""

    model_type: Literal["qwen3"] = "qwen3"


def _draft_vocabulary_tensors(draft_vocab: int, vocab: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """A draft vocabulary's own LM-head rows and its maps (draft id -> target id offsets, target mask)."""
    return {"lm_head.weight": (draft_vocab, hidden), "d2t": (draft_vocab,), "t2d": (vocab,)}


class _FolderConfig(_Model):
    """What every ``speculators`` folder's ``config.json`` has, whatever its model type."""

    speculators_config: SpeculatorsSection
    draft_vocab_size: int = Field(ge=1)
    target_hidden_size: int = Field(ge=1)
    jetflow: dict[str, Any] = Field(default_factory=dict, description="provenance: checkpoint, recipe")
    transformer_layer_config: DraftLayerConfig

    def _check_layer(self) -> None:
        """The checks on the vocabulary and the attention heads that every folder shares."""
        layer = self.transformer_layer_config
        if self.draft_vocab_size > layer.vocab_size:
            raise ValueError("draft_vocab_size exceeds the target's vocabulary")
        if layer.num_attention_heads % layer.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def speculative_tokens(self) -> int:
        return self.speculators_config.proposal_methods[0].speculative_tokens

    def chain_tokens(self, budget: int) -> int:
        """vLLM's ``num_speculative_tokens`` for a chain of ``budget`` drafted tokens.

        An autoregressive head drafts any number of steps, one at a time, like jetflow's chain
        policy; a block head is bounded by its block (see :class:`DFlashConfig`).
        """
        return budget

    @property
    def own_lm_head(self) -> bool:
        """A draft vocabulary ships its LM-head rows and maps; the full one shares the target's."""
        return self.draft_vocab_size < self.transformer_layer_config.vocab_size


class DFlashConfig(_FolderConfig):
    """``config.json`` of a DFlash folder (``speculators_model_type = "dflash"``)."""

    speculators_model_type: Literal["dflash"] = "dflash"
    architectures: tuple[Literal["DFlashDraftModel"], ...] = ("DFlashDraftModel",)
    transformer_layer_config: LayerConfig
    mask_token_id: int = Field(ge=0)
    aux_hidden_state_layer_ids: tuple[int, ...] = Field(
        min_length=1, description="target layers whose outputs feed the head (hidden_states[i])"
    )
    sliding_window_non_causal: bool = Field(
        description="vLLM's name for a bidirectional block; false: the causal in-block mask (JetFlow)"
    )
    block_size: int = Field(ge=2, description="anchor + mask slots")

    @model_validator(mode="after")
    def _consistent(self) -> DFlashConfig:
        layer = self.transformer_layer_config
        tokens = self.speculators_config.proposal_methods[0].speculative_tokens
        if self.speculators_config.algorithm != "dflash":
            raise ValueError("a DFlash folder's speculators_config.algorithm must be dflash")
        if tokens > self.block_size - 1:
            raise ValueError(f"speculative_tokens {tokens} exceeds the block's {self.block_size - 1} slots")
        if self.sliding_window_non_causal and tokens != self.block_size - 1:
            raise ValueError(
                "a bidirectional block sees all its slots: speculative_tokens must be block_size - 1"
            )
        self._check_layer()
        if not 0 <= self.mask_token_id < layer.vocab_size:
            raise ValueError("mask_token_id is outside the target's vocabulary")
        return self

    @property
    def causal(self) -> bool:
        return not self.sliding_window_non_causal

    def chain_tokens(self, budget: int) -> int:
        """A causal block's slot ``i`` sees only slots before it, so its first ``budget`` slots draft
        what a shorter block would; a bidirectional block drafts all of its slots or none."""
        return min(budget, self.block_size - 1) if self.causal else self.block_size - 1

    def summary(self) -> str:
        kind = "causal" if self.causal else "bidirectional"
        return f"dflash ({kind} block of {self.block_size}, {self.speculative_tokens} tokens)"

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
            shapes |= _draft_vocabulary_tensors(self.draft_vocab_size, layer.vocab_size, hidden)
        return shapes


class Eagle3LayerConfig(DraftLayerConfig):
    """``transformer_layer_config`` of an Eagle3 head: one layer of the target's family; vLLM builds
    ``Eagle3LlamaForCausalLM`` for ``llama`` (no q/k norms) and ``Eagle3Qwen3ForCausalLM`` for
    ``qwen3`` (q/k RMSNorm per head)."""

    model_type: Literal["llama", "qwen3"]
    num_hidden_layers: Literal[1] = 1
    mlp_bias: Literal[False] = False


class Eagle3Config(_FolderConfig):
    """``config.json`` of an Eagle3 folder (``speculators_model_type = "eagle3"``).

    The four norm options are written explicitly: vLLM's defaults for an absent field differ
    between its readers (``norm_before_residual`` is true in the speculators parser).
    """

    speculators_model_type: Literal["eagle3"] = "eagle3"
    architectures: tuple[Literal["Eagle3Speculator"], ...] = ("Eagle3Speculator",)
    transformer_layer_config: Eagle3LayerConfig
    eagle_aux_hidden_state_layer_ids: tuple[int, ...] = Field(
        min_length=1, description="target layers feeding fc, in increasing order (hidden_states[i])"
    )
    norm_before_residual: bool = Field(description="the residual starts from hidden_norm(state)")
    norm_output: bool = Field(description="the next step's state is the normed output, not the pre-norm")
    norm_before_fc: bool = Field(description="one RMSNorm over the concatenated target states before fc")
    fc_norm: bool = Field(description="an RMSNorm per target state before fc")

    @model_validator(mode="after")
    def _consistent(self) -> Eagle3Config:
        if self.speculators_config.algorithm != "eagle3":
            raise ValueError("an Eagle3 folder's speculators_config.algorithm must be eagle3")
        self._check_layer()
        ids = self.eagle_aux_hidden_state_layer_ids
        if list(ids) != sorted(set(ids)):
            raise ValueError("vLLM concatenates the aux hidden states in increasing layer order: sort them")
        return self

    def summary(self) -> str:
        layer = self.transformer_layer_config
        return f"eagle3 ({layer.model_type} layer, {self.speculative_tokens} tokens per step)"

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor name vLLM's Eagle3 model loads from ``model.safetensors``, with its shape.

        The embedding is not among them: vLLM shares the target's when the folder has none.
        """
        layer = self.transformer_layer_config
        hidden, d = layer.hidden_size, layer.head_dim
        q, kv, inter = layer.num_attention_heads * d, layer.num_key_value_heads * d, layer.intermediate_size
        fused = self.target_hidden_size * len(self.eagle_aux_hidden_state_layer_ids)
        p = "layers.0."
        shapes: dict[str, tuple[int, ...]] = {
            "fc.weight": (hidden, fused),
            "norm.weight": (hidden,),
            p + "input_layernorm.weight": (hidden,),
            p + "hidden_norm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q, 2 * hidden),
            p + "self_attn.k_proj.weight": (kv, 2 * hidden),
            p + "self_attn.v_proj.weight": (kv, 2 * hidden),
            p + "self_attn.o_proj.weight": (hidden, q),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        if layer.model_type == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if self.norm_before_fc:
            shapes["input_norm.weight"] = (fused,)
        if self.fc_norm:
            for i in range(len(self.eagle_aux_hidden_state_layer_ids)):
                shapes[f"fc_norm.{i}.weight"] = (self.target_hidden_size,)
        if self.own_lm_head:
            shapes |= _draft_vocabulary_tensors(self.draft_vocab_size, layer.vocab_size, hidden)
        return shapes


SpeculatorsConfig = Annotated[DFlashConfig | Eagle3Config, Field(discriminator="speculators_model_type")]
#: reads either kind of folder's ``config.json`` by its ``speculators_model_type``
SPECULATORS_CONFIG: TypeAdapter[DFlashConfig | Eagle3Config] = TypeAdapter(SpeculatorsConfig)


@dataclass(frozen=True)
class SpeculatorsExport:
    """A folder's contents before it is written.

    Attributes:
        config: the validated ``config.json``.
        tensors: ``model.safetensors``, named as vLLM loads them.
        mask_embedding: ``[H]`` a DFlash head's learned mask-slot input, for ``mask_embedding.pt``;
            None for a format without mask slots (Eagle3).
    """

    config: DFlashConfig | Eagle3Config
    tensors: dict[str, Tensor]
    mask_embedding: Tensor | None = None
