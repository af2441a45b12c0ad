"""Online training data: a corpus's sequences with the target's states computed when they are read.

The offline feature cache of a corpus grows with the target's width and depth (34 GB for the
135M embedded target's 3M response tokens; terabytes for an 8B one), so a large target trains
*online*: the frozen target runs inside the training loop, once per step over that step's
sequences, and nothing but checkpoints is written. The states come from the same
teacher-forced forward that fills the cache (:func:`~.features.teacher_forced_states`), cast
to the cache's dtype, so online and offline runs train on the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jetflow.core.precision import dtype_name
from jetflow.core.target import Target
from jetflow.drafters.training.contracts import Record
from jetflow.drafters.training.corpus import Corpus
from jetflow.drafters.training.features import check_layers, teacher_forced_states
from torch import Tensor

#: padded tokens per target forward on an accelerator: a step's few sequences fit one batch
ACCELERATOR_TOKEN_BUDGET = 16384


def forward_token_budget(device: torch.device) -> int:
    """Padded tokens per online forward: a step's sequences in one padded forward on an
    accelerator, which one wide forward fills; one sequence per forward on a CPU, where padding
    to the longest only adds work (4 sequences of the embedded target's corpus: 5.0 s apart,
    8.2 s padded into one forward, one thread)."""
    return 1 if device.type == "cpu" else ACCELERATOR_TOKEN_BUDGET


class OnlineStore:
    """The sequences of ``corpus`` with ``features`` and ``final`` from a forward of ``target``.

    The target runs in inference mode and in the dtype it was loaded in; the trainer reads a
    step's sequences in one call (:meth:`sequences`), batched into padded forwards where that
    pays (:func:`forward_token_budget`).
    """

    def __init__(
        self,
        corpus: Corpus,
        target: Target,
        layers: Sequence[int],
        limit: int | None = None,
        token_budget: int | None = None,
    ) -> None:
        """``limit``: serve the first ``limit`` sequences only; ``token_budget``: padded tokens a
        forward (default: :func:`forward_token_budget` of the target's device)."""
        self.corpus = corpus
        self.target = target
        self.layers = check_layers(layers, target.num_layers)
        self.token_budget = token_budget or forward_token_budget(target.device)
        self._length = len(corpus) if limit is None else min(len(corpus), limit)
        described = ("source", "target", "settings", "counts", "regeneration")
        #: What the data is, small enough to copy into a checkpoint (no id list).
        self.manifest: dict[str, Any] = {
            "corpus": corpus.name,
            **{key: corpus.manifest.get(key) for key in described},
            "feature_layers": list(self.layers),
            "features": "online",
            "features_computed_in": [dtype_name(target.dtype)],
        }

    def __len__(self) -> int:
        return self._length

    def tokens(self, index: int) -> tuple[Tensor, int]:
        """``tokens [T]`` int64 and the prompt length, read from the corpus (no forward)."""
        if not 0 <= index < self._length:
            raise IndexError(f"sequence {index} out of range for a store of {self._length}")
        return self.corpus.sequence(index)

    def sequence(self, index: int) -> Record:
        """One sequence with its states: a target forward of its own."""
        return self.sequences([index])[0]

    def sequences(self, indices: Sequence[int]) -> list[Record]:
        """The sequences ``indices`` with ``features [T-1, k, H]`` and ``final [T-1, H]`` (fp16),
        from target forwards of at most ``token_budget`` padded tokens each (at least one sequence)."""
        texts = [self.tokens(int(i)) for i in indices]
        features, finals = teacher_forced_states(
            self.target.model, [tokens for tokens, _ in texts], self.layers, self.token_budget
        )
        return [
            (tokens, prompt_length, feature, final)
            for (tokens, prompt_length), feature, final in zip(texts, features, finals, strict=True)
        ]
