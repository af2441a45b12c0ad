"""What every drafter with a trained head shares: checkpoints, the shipped recipe, the cache.

A learned drafter loads its head from a checkpoint (``drafter_params.checkpoint``, else the
head shipped for the target under ``checkpoints/<target name>/`` beside the plugin module),
checked against the target's fingerprint; the target's embedding and LM head are shared,
frozen, and restricted to the head's draft vocabulary if it has one. Subclasses say how to
rebuild their head from a checkpoint's architecture record and how to make a fresh one.
"""

from __future__ import annotations

import hashlib
import inspect
from abc import abstractmethod
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic

from jetflow.core.contracts import Drafter
from jetflow.core.errors import JetflowError
from jetflow.core.packed_weights import pack_linear_weights
from jetflow.drafters.blocks import DraftLMHead, FrozenTargetParts
from jetflow.drafters.checkpoint import WEIGHTS_FILE, CheckpointInfo, load_checkpoint, load_weights
from jetflow.drafters.draft_head import CacheT, DraftHead
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from jetflow.core.target import Target

#: the training recipe a learned drafter ships beside its module
DEFAULT_TRAIN_CONFIG = "train.toml"


class LearnedParams(BaseModel):
    """The run-time parameters every learned drafter takes; a drafter's own model adds to them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str | None = Field(
        None, description="checkpoint folder; default: the head shipped for the target"
    )


class LearnedDrafter(Drafter, Generic[CacheT]):
    """A drafter whose proposals come from a trained head; ``params.checkpoint`` picks one."""

    Params: ClassVar[type[LearnedParams]] = LearnedParams
    params: LearnedParams
    head: DraftHead[CacheT]

    def __init__(self, params: LearnedParams, target: Target) -> None:
        super().__init__(params, target)
        self.checkpoint = self.checkpoint_for(params, target)
        self.head, _ = self.load_head(self.checkpoint, target)
        self.head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        pack_linear_weights(self.head)  # as the target's: frozen from here on
        self.shared = FrozenTargetParts.from_target(target)
        self.lm = DraftLMHead.build(self.shared.lm_head, self.head.draft_tokens)
        self._cache: CacheT = self.head.empty_cache()

    # ------------------------------------------------------------------ the head
    @classmethod
    def checkpoint_for(cls, params: LearnedParams, target: Target) -> Path:
        """The checkpoint ``params`` name, else the head shipped for ``target``."""
        return Path(params.checkpoint) if params.checkpoint else cls.shipped_checkpoint(target)

    @classmethod
    def load_head(cls, checkpoint: Path, target: Target) -> tuple[DraftHead[CacheT], CheckpointInfo]:
        """The head stored at ``checkpoint`` as it was saved (on the CPU, trainable layout) and its
        record; a clear error if it is not this drafter's or does not fit ``target``."""
        info, state = load_checkpoint(checkpoint, target, drafter=cls.name)
        head = cls.head_from_architecture(info.architecture)
        load_weights(head, state, checkpoint)
        return head, info

    @classmethod
    @abstractmethod
    def head_from_architecture(cls, architecture: dict[str, Any]) -> DraftHead[CacheT]:
        """Rebuild a head from a checkpoint's architecture record (clear error if unreadable)."""

    @classmethod
    @abstractmethod
    def new_head(cls, target: Target, options: dict[str, Any]) -> DraftHead[CacheT]:
        """A freshly initialised head for ``target``; ``options`` override the derived sizes."""

    # ------------------------------------------------------------------ where things live
    @classmethod
    def package_dir(cls) -> Path:
        """The folder of the drafter's plugin module: its shipped heads and training recipe."""
        return Path(inspect.getfile(cls)).parent

    @cached_property
    def weights_digest(self) -> str:
        """The head's weights file by content: a head retrained into the same folder is another head."""
        with (self.checkpoint / WEIGHTS_FILE).open("rb") as weights:
            return hashlib.file_digest(weights, "sha256").hexdigest()[:20]

    @classmethod
    def available_for(cls, target: Target) -> bool:
        return (cls.package_dir() / "checkpoints" / target.name / "config.json").is_file()

    @classmethod
    def shipped_checkpoint(cls, target: Target) -> Path:
        """The head shipped for ``target`` (by its name), or a clear error if there is none."""
        if not cls.available_for(target):
            raise JetflowError(
                f"no {cls.name} head is shipped for target {target.name!r}; train one with "
                f"`jetflow train --drafter {cls.name} --config FILE` and pass "
                f"drafter_params.checkpoint=FOLDER"
            )
        return cls.package_dir() / "checkpoints" / target.name

    @classmethod
    def default_train_config(cls) -> Path:
        """The training recipe shipped with the drafter."""
        return cls.package_dir() / DEFAULT_TRAIN_CONFIG

    # ------------------------------------------------------------------ per sequence
    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.config.feature_layers

    def reset(self) -> None:
        self._cache = self.head.empty_cache()
