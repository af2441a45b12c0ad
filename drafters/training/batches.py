"""Which sequences a run trains and evaluates on, and the anchored batches made of them.

Everything here is a fixed function of the data, the step and the seed, so a resumed run (or
a run split over processes) reads exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jetflow.core.errors import ConfigError
from jetflow.drafters.examples import ExampleBatch
from jetflow.drafters.training.contracts import SequenceStore
from jetflow.drafters.training.distributed import DataParallel
from jetflow.drafters.training.examples import collate, sample_anchors
from torch import Tensor

#: the held-out split is drawn with its own seed: every training seed evaluates on the same sequences
SPLIT_SEED = 1234


def split_ids(
    store: SequenceStore,
    eval_store: SequenceStore | None,
    holdout_sequences: int,
    max_sequences: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Training ids (of ``store``) and evaluation ids (of ``eval_store``, else of ``store``).

    With a separate evaluation store, every training sequence trains and evaluation reads
    its first ``holdout_sequences``: runs on different amounts of data share one yardstick.
    Otherwise ``holdout_sequences`` (at most half) are held out of the first ``max_sequences``.
    """
    n = min(len(store), max_sequences or len(store))
    if n < 1:
        raise ConfigError("the training data holds no sequences")
    if eval_store is not None:
        return torch.arange(n), torch.arange(min(holdout_sequences, len(eval_store)))
    holdout = min(holdout_sequences, n // 2)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    if n - holdout < 1:
        raise ConfigError(f"the data has {n} sequences: too few to train on")
    return order[holdout:], order[:holdout]


class StepSequences:
    """The training sequences of each step: consecutive slices of per-epoch permutations."""

    def __init__(self, train_ids: Tensor, batch_sequences: int, seed: int) -> None:
        self.train_ids = train_ids
        self.batch_sequences = batch_sequences
        self.seed = seed
        self._epoch_order: tuple[int, Tensor] | None = None  # (epoch, permutation of train_ids)

    def ids(self, step: int) -> list[int]:
        """The sequence ids of ``step`` (0-based), the same whenever they are asked for."""
        n, size = len(self.train_ids), self.batch_sequences
        ids = []
        for slot in range(step * size, (step + 1) * size):
            epoch, offset = divmod(slot, n)
            ids.append(int(self.train_ids[self._permutation(epoch)[offset]]))
        return ids

    def _permutation(self, epoch: int) -> Tensor:
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._epoch_order = (epoch, torch.randperm(len(self.train_ids), generator=generator))
        return self._epoch_order[1]


def anchored_batch(
    store: SequenceStore,
    ids: Sequence[int],
    anchors_per_sequence: int,
    generator: torch.Generator,
    device: torch.device,
    parallel: DataParallel | None = None,
) -> ExampleBatch:
    """The batch of sequences ``ids`` of ``store`` with random anchors, on ``device``.

    Anchors are drawn for every sequence of ``ids`` in order (from its tokens alone), so a
    sequence gets the same anchors whichever process trains on it; with ``parallel``, only
    this process's share of the sequences is read, in one call (an online store runs the
    target once over them).
    """
    anchors = []
    for index in ids:
        tokens, prompt = store.tokens(index)
        # states cover the T - 1 positions with a next token (or all T: the same anchors)
        length = int(tokens.shape[0])
        anchors.append(sample_anchors(prompt, length, length - 1, anchors_per_sequence, generator))
    mine = list(range(len(ids))) if parallel is None else parallel.shard(range(len(ids)))
    records = store.sequences([ids[i] for i in mine])
    return collate(records, [anchors[i] for i in mine], dtype=torch.float32).to(device)
