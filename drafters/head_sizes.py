"""The sizes every learned head shares (block heads and EAGLE), derived from the target by default.

A head's config is this model plus its own fields; the checkpoint's ``architecture`` record
is that config's dump, so a head rebuilds from a checkpoint with ``model_validate``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Self

from jetflow.drafters.blocks import AttentionShape
from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from jetflow.core.target import Target


def default_feature_layers(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """``count`` layers spread evenly from 1 to ``L - 3`` (30 layers: 1, 8, 14, 20, 27)."""
    top = max(num_layers - 3, 1)
    if count == 1:
        return (1,)
    return tuple(sorted({round(1 + (top - 1) * i / (count - 1)) for i in range(count)}))


class HeadSizes(BaseModel):
    """Attention sizes, fused feature layers and draft vocabulary of a head."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = Field(ge=1)
    feature_layers: tuple[int, ...] = Field(min_length=1, description="1-based target layers fused")
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=2)
    intermediate_size: int = Field(ge=1)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qk_norm: bool = True
    draft_vocab_size: int | None = Field(
        None, ge=1, description="draft over the N most frequent response tokens only; None: full vocabulary"
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> Self:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embedding)")
        return self

    @classmethod
    def default_layers(cls, num_layers: int) -> tuple[int, ...]:
        """The target layers a head of this kind fuses unless told otherwise."""
        return default_feature_layers(num_layers)

    @classmethod
    def for_target(cls, target: Target, **overrides: object) -> Self:
        """Attention sizes copied from the target's config; ``overrides`` win."""
        config = target.config
        heads = int(config.num_attention_heads)
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        derived = {
            "hidden_size": target.hidden_size,
            "feature_layers": cls.default_layers(target.num_layers),
            "num_heads": heads,
            "num_kv_heads": int(getattr(config, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(config, "head_dim", None) or target.hidden_size // heads),
            "intermediate_size": int(config.intermediate_size),
            "rope_theta": float(theta),
            "rms_norm_eps": float(getattr(config, "rms_norm_eps", 1e-6)),
        }
        return cls.model_validate(derived | overrides)

    def transformers_fields(self) -> dict[str, object]:
        """The layer sizes under transformers' config names: the inverse of :meth:`for_target`."""
        return {
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
        }

    def attention_shape(self) -> AttentionShape:
        return AttentionShape(
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            qk_norm=self.qk_norm,
        )
