"""A recipe's head options fitted to the target the head is trained for.

Everything a head's sizes can take from the target is derived by the head itself
(:meth:`~jetflow.drafters.head_sizes.HeadSizes.for_target`: feature layers spread over the
target's depth, attention and MLP sizes from its config). What a recipe fixes in absolute
numbers for the target it was written for is fitted here, so one shipped recipe trains a
head for any target.
"""

from __future__ import annotations

import logging
from typing import Any

from jetflow.core.target import Target

log = logging.getLogger(__name__)

#: a draft vocabulary must leave out at least this share of the target's to save LM-head work
MIN_DRAFT_VOCAB_SAVING = 0.5


def fitted_head_options(options: dict[str, Any], target: Target) -> dict[str, Any]:
    """``options`` with a ``draft_vocab_size`` too large for ``target``'s vocabulary dropped.

    A draft vocabulary of ``N`` of the target's ``V`` tokens cuts the LM head's work by
    ``V / N`` and caps agreement at the share of responses it covers; at ``N >= V / 2`` it
    saves little and at ``N >= V`` it is meaningless (the shipped recipe's 8,192 tokens were
    chosen for a 49K vocabulary), so the head drafts over the full vocabulary instead.
    """
    size = options.get("draft_vocab_size")
    if size is None or size < target.vocab_size * MIN_DRAFT_VOCAB_SAVING:
        return options
    log.info(
        "draft_vocab_size %d is not under half of %s's vocabulary (%d): drafting over all of it",
        size,
        target.name,
        target.vocab_size,
    )
    return options | {"draft_vocab_size": None}
