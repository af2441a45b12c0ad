"""A head's draft vocabulary: the most frequent tokens of the training responses.

Drafting over a few thousand tokens instead of the target's whole vocabulary cuts the LM-head
cost that dominates training and drafting on a CPU; the share of response tokens the chosen
ones cover bounds any draft's per-token agreement, so it is recorded with the head.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from jetflow.core.errors import ConfigError
from jetflow.drafters.training.contracts import SequenceStore
from jetflow.drafters.training.examples import response_token_counts
from torch import Tensor

log = logging.getLogger(__name__)

#: the checkpoint's data record keys this module writes
VOCAB_KEYS_PREFIX = "draft_vocab"


def choose_draft_vocab(
    draft_tokens: Tensor, store: SequenceStore, train_ids: Tensor, vocab_size: int
) -> dict[str, Any]:
    """Fill ``draft_tokens`` (``[N]``, in place) with the ``N`` most frequent training-response tokens.

    Returns what the checkpoint records: the size and the share of response tokens covered.
    """
    size = int(draft_tokens.shape[0])
    if size >= vocab_size:
        raise ConfigError(f"draft_vocab_size {size} must be below the target's vocabulary ({vocab_size})")
    counts = response_token_counts(store, train_ids.tolist(), vocab_size)
    chosen = torch.sort(counts, descending=True, stable=True).indices[:size]
    with torch.no_grad():
        draft_tokens.copy_(chosen.sort().values)
    coverage = float(counts[chosen].sum() / counts.sum().clamp(min=1))
    log.info("draft vocabulary: %d tokens cover %.2f%% of training responses", size, 100 * coverage)
    return {"draft_vocab_size": size, "draft_vocab_coverage": round(coverage, 5)}


def recorded_vocab(data: dict[str, Any]) -> dict[str, Any]:
    """The draft-vocabulary part of a checkpoint's data record (a warm start keeps it)."""
    return {key: value for key, value in data.items() if key.startswith(VOCAB_KEYS_PREFIX)}
