"""What every drafter with a trained head shares: checkpoints, the shipped recipe, the cache.

A learned drafter loads its head from a checkpoint (``drafter_params.checkpoint``, else the
head shipped for the target under ``checkpoints/<target name>/`` beside the plugin module),
checked against the target's fingerprint; the target's embedding and LM head are shared,
frozen, and restricted to the head's draft vocabulary if it has one. Subclasses say how to
rebuild their head from a checkpoint's architecture record and how to make a fresh one.
"""

from __future__ import annotations

import hashlib
import sys
from abc import abstractmethod
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jetflow.core.contracts import Drafter
from jetflow.core.errors import JetflowError
from jetflow.core.packed_weights import pack_linear_weights
from jetflow.drafters.blocks import DraftLMHead, FrozenTargetParts
from jetflow.drafters.checkpoint import WEIGHTS_FILE, load_checkpoint, load_weights
from pydantic import BaseModel
from torch import nn

if TYPE_CHECKING:
    from jetflow.core.target import Target

#: the training recipe a learned drafter ships beside its module
DEFAULT_TRAIN_CONFIG = "train.toml"


class LearnedDrafter(Drafter):
    """A drafter whose proposals come from a trained head; ``params.checkpoint`` picks one."""

    def __init__(self, params: BaseModel, target: Target) -> None:
        super().__init__(params, target)
        checkpoint = getattr(params, "checkpoint", None)
        self.checkpoint = Path(checkpoint) if checkpoint else self.shipped_checkpoint(target)
        info, state = load_checkpoint(self.checkpoint, target, drafter=self.name)
        self.head = self.head_from_architecture(info.architecture)
        load_weights(self.head, state, self.checkpoint)
        self.head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        pack_linear_weights(self.head)  # as the target's: frozen from here on
        self.shared = FrozenTargetParts.from_target(target)
        self.lm = DraftLMHead.build(self.shared.lm_head, self.head.draft_tokens)
        self.checkpoint_info = info
        self._cache = self.head.empty_cache()

    # ------------------------------------------------------------------ the head
    @classmethod
    @abstractmethod
    def head_from_architecture(cls, architecture: dict[str, Any]) -> nn.Module:
        """Rebuild a head from a checkpoint's architecture record (clear error if unreadable)."""

    @classmethod
    @abstractmethod
    def new_head(cls, target: Target, options: dict[str, Any]) -> nn.Module:
        """A freshly initialised head for ``target``; ``options`` override the derived sizes."""

    # ------------------------------------------------------------------ where things live
    @classmethod
    def package_dir(cls) -> Path:
        return Path(sys.modules[cls.__module__].__file__).parent

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
