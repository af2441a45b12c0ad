"""What every trained head is, whichever drafter runs it: a torch module with its sizes, its
draft vocabulary and a per-sequence context cache.

The learned drafters load heads through this type, and the exporter reads a head from a
checkpoint through it, without a runtime drafter around the head.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Generic, TypeVar

from jetflow.drafters.head_sizes import HeadSizes
from torch import Tensor, nn

if TYPE_CHECKING:
    from jetflow.drafters.blocks import FrozenTargetParts
    from jetflow.drafters.examples import ExampleBatch, Predictions

#: the head's per-sequence cache of context keys and values (only the head reads it)
CacheT = TypeVar("CacheT")


class DraftHead(nn.Module, Generic[CacheT]):
    """A trained head; owns no embedding or LM head (the target's are shared, frozen)."""

    #: the hyper-parameters, saved as a checkpoint's ``architecture``
    config: HeadSizes
    #: ``[N]`` vocabulary ids of the draft vocabulary, or None: the full vocabulary
    draft_tokens: Tensor | None

    @abstractmethod
    def empty_cache(self) -> CacheT:
        """The context cache of a new sequence."""

    @property
    @abstractmethod
    def max_depth(self) -> int:
        """Depths drafted from one root (the block size less one, or the autoregressive steps)."""

    @abstractmethod
    def training_predictions(self, batch: ExampleBatch, shared: FrozenTargetParts) -> Predictions:
        """The head's predictions at a batch's anchors: the shared trainer's one hook."""
