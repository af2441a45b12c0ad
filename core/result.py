"""What a generation run returns: tokens, text and per-step statistics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["length", "eos", "stop"]


@dataclass(frozen=True)
class StepRecord:
    """One draft-verify step.

    Attributes:
        accepted: drafted tokens accepted (the step emits ``accepted + 1`` tokens).
        tree_size: nodes verified, root included.
        draft_s: seconds spent drafting (drafter forward and tree building).
        verify_s: seconds spent in the target forward, acceptance and cache commit.
        draft_forwards: drafter model forwards run to build the tree (a session's ``forwards``;
            0 for a model-free drafter, 1 for a parallel head, one per level for EAGLE).
        budget: the nodes drafted for this sequence this step (0 when nothing was drafted).
        rows: sequences verified in the step's one target forward (1 unbatched).
        batch_budget: the nodes drafted for all of them (``budget`` unbatched): the split of
            ``batch_budget`` across the rows is each one's ``budget``.
    """

    accepted: int
    tree_size: int
    draft_s: float
    verify_s: float
    draft_forwards: int = 0
    budget: int = 0
    rows: int = 1
    batch_budget: int = 0


@dataclass
class GenerationResult:
    """The output of one prompt and how it was produced."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    wall_s: float
    budget: int | None
    steps: list[StepRecord] = field(default_factory=list)
    #: the part of ``wall_s`` spent prefilling the prompt (target and drafter), before any step
    prefill_s: float = 0.0
    #: the verify forward's attention: ``triton-tree`` (the CUDA tree kernel) or ``sdpa``
    attention: str = "sdpa"
    #: the target's linear weights: ``packed`` once for oneDNN (CPU bfloat16) or ``plain``
    linear_weights: str = "plain"

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target verify step (1.0 for autoregressive decoding)."""
        return self.new_tokens / max(len(self.steps), 1)

    @property
    def draft_s(self) -> float:
        return sum(step.draft_s for step in self.steps)

    @property
    def verify_s(self) -> float:
        return sum(step.verify_s for step in self.steps)

    @property
    def draft_forwards(self) -> int:
        return sum(step.draft_forwards for step in self.steps)

    def stats(self) -> dict[str, object]:
        """The summary printed by ``jetflow generate --json``."""
        return {
            "new_tokens": self.new_tokens,
            "steps": len(self.steps),
            "tau": round(self.tau, 4),
            "tokens_per_s": round(self.new_tokens / self.wall_s, 3) if self.wall_s else 0.0,
            "wall_s": round(self.wall_s, 4),
            "prefill_s": round(self.prefill_s, 4),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "draft_forwards_per_step": round(self.draft_forwards / max(len(self.steps), 1), 4),
            "budget": self.budget,
            "budgets": self.budget_histogram() if self.budget is not None else None,
            "attention": self.attention,
            "linear_weights": self.linear_weights,
        }

    def budget_histogram(self) -> dict[str, int]:
        """How many steps ran at each budget (one entry unless the budget is adaptive)."""
        counts = Counter(step.budget for step in self.steps)
        return {str(budget): counts[budget] for budget in sorted(counts)}

    def accept_histogram(self) -> dict[int, int]:
        """How many steps accepted each number of drafted tokens."""
        counts: dict[int, int] = {}
        for step in self.steps:
            counts[step.accepted] = counts.get(step.accepted, 0) + 1
        return dict(sorted(counts.items()))
