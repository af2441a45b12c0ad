"""What the trainer is given, as declared protocols: the head it trains and the stores it reads.

A head is any torch module of a drafter plugin with these members (the jetflow, dflash and
eagle heads are); a store is anything that serves target-regenerated sequences with their
target states (the feature cache, the target itself run online, several of them read as one,
or a list in memory).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from jetflow.core.errors import ConfigError
from jetflow.drafters.blocks import FrozenTargetParts
from jetflow.drafters.examples import ExampleBatch, Predictions
from jetflow.drafters.head_sizes import HeadSizes
from torch import Tensor, nn

#: one sequence: tokens ``[T]``, prompt length, features ``[F, k, H]``, final states ``[F, H]``
Record = tuple[Tensor, int, Tensor, Tensor]


@runtime_checkable
class SequenceStore(Protocol):
    """Where the trainer reads sequences from, and what it records about them."""

    @property
    def layers(self) -> tuple[int, ...]:
        """The target layers the features were taken from (the head must read the same)."""
        ...

    @property
    def manifest(self) -> Mapping[str, Any]:
        """What the data is (source, counts, ...), small enough to copy into a checkpoint."""
        ...

    def __len__(self) -> int: ...

    def sequence(self, index: int) -> Record:
        """``(tokens [T] long, prompt_length, features [F, k, H] fp16, final [F, H] fp16)``."""
        ...

    def sequences(self, indices: Sequence[int]) -> list[Record]:
        """Several sequences at once: a store that computes states (online) batches them."""
        ...

    def tokens(self, index: int) -> tuple[Tensor, int]:
        """``(tokens [T] long, prompt_length)`` without the states: cheap in every store."""
        ...


class TrainableHead(Protocol):
    """What the trainer needs from a head: its sizes, its training hook and the module it is."""

    @property
    def config(self) -> HeadSizes:
        """The hyper-parameters, saved as the checkpoint's architecture."""
        ...

    @property
    def max_depth(self) -> int:
        """Depths predicted per anchor."""
        ...

    @property
    def draft_tokens(self) -> Tensor | None:
        """``[N]`` draft-vocabulary ids (the trainer fills them in place), or None: full vocabulary."""
        ...

    def training_predictions(self, batch: ExampleBatch, shared: FrozenTargetParts) -> Predictions: ...

    # the torch module side the trainer drives
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...

    def to(self, device: torch.device, /) -> Any: ...


def check_store_layers(store: SequenceStore, head_layers: tuple[int, ...]) -> None:
    """Refuse a store whose features come from other target layers than the head reads."""
    layers = tuple(store.layers)
    if layers and head_layers and layers != head_layers:
        raise ConfigError(
            f"the feature cache holds layers {list(layers)}, but the head reads {list(head_layers)}"
        )
