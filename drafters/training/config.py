"""The recipe of a training run: one frozen model, loadable from TOML on top of a base recipe."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from jetflow.core.config import build_config, load_layered_toml, merge
from jetflow.drafters.training.losses import LossConfig
from jetflow.drafters.training.optim import OptimConfig
from pydantic import BaseModel, ConfigDict, Field, field_validator


class TrainConfig(BaseModel):
    """Everything that decides one training run (``jetflow train --config FILE``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    drafter: str = Field(default="jetflow", description="drafter plugin whose head is trained")
    target: str = Field(default="default", description="target spec, as for `jetflow generate`")
    corpus: list[str] | None = Field(
        default=None,
        description="corpus folder(s), read as one; default: the default target's first and second turns",
    )
    features: str | None = Field(
        default=None, description="feature cache folder of a single corpus; default: its cache"
    )
    target_dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        default="float32",
        description=(
            "dtype the target is loaded in: its frozen embedding and LM head (the teacher) and, online, "
            "its forward. float32 keeps the teacher exact; a large target trains online in its own "
            "bfloat16 (half the memory); auto: bfloat16 where it is native"
        ),
    )
    online: bool = Field(
        default=False,
        description=(
            "run the frozen target inside the loop for each step's features and teacher (no "
            "feature cache is read or written: what a target too large to cache needs)"
        ),
    )
    out: str = Field(default="runs/train", description="output folder: log, checkpoints, final head")
    head: dict[str, Any] = Field(default_factory=dict, description="head hyper-parameters (drafter's own)")
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    steps: int = Field(default=1000, ge=1)
    batch_sequences: int = Field(default=4, ge=1, description="sequences per optimiser step")
    anchors_per_sequence: int = Field(default=64, ge=1, description="random anchors drawn per sequence")
    holdout_sequences: int = Field(
        default=32,
        ge=0,
        description="sequences evaluated on: of eval_corpus, else held out of the training data",
    )
    eval_corpus: str | None = Field(
        default=None,
        description=(
            "corpus folder evaluated on (never trained on); default: the first corpus's `-heldout` "
            "sibling where it exists, else holdout_sequences drawn from the training data"
        ),
    )
    max_sequences: int | None = Field(
        default=None, ge=2, description="use only the first N sequences (fixed-data ablations); None: all"
    )
    warm_start: str | None = Field(
        default=None,
        description=(
            "head checkpoint to continue from when no resumable state is left (a final head or a "
            "checkpoint folder): its weights and step; the optimiser moments start at zero and the "
            "rate re-warms over warmup_steps. A resumable checkpoint in `out` wins over it"
        ),
    )
    eval_every: int = Field(default=100, ge=1)
    checkpoint_every: int = Field(default=250, ge=1)
    keep_checkpoints: int = Field(default=2, ge=1)
    log_every: int = Field(default=10, ge=1)
    loss_chunk_rows: int = Field(default=1024, ge=1, description="rows per LM-head chunk (bounds memory)")
    seed: int = 0
    ship_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description=(
            "dtype of the head's matrix products in training steps (autocast; the weights, the "
            "optimiser, the teacher and evaluation stay fp32); auto: bf16 where it is native"
        ),
    )

    @field_validator("corpus", mode="before")
    @classmethod
    def _one_corpus_is_a_list(cls, value: Any) -> Any:
        """A recipe may name a single corpus as a string; everything downstream reads a list."""
        return [value] if isinstance(value, str) else value

    @classmethod
    def from_toml(
        cls, path: str | Path, settings: dict[str, Any] | None = None, **overrides: Any
    ) -> TrainConfig:
        """Read a recipe file (on top of its ``base``); ``settings`` (``--set``) and overrides win."""
        data = merge(load_layered_toml(path), settings or {})
        data |= {key: value for key, value in overrides.items() if value is not None}
        return build_config(cls, data)
