"""Is every method's greedy output the baseline's? And if not, is that rounding or a bug?

Speculative decoding is lossless with respect to the logits of the verify pass, but a 16-token
forward and a 1-token forward do not round identically. In float32 through the plain kernels that
never flips an argmax in practice (0 of 463 teacher-forced positions on the embedded target), so
any mismatch is a real divergence. In bf16/fp16 it does, at near-ties, and so can float32 where
other kernels serve other row counts (compiled graphs, packed weights): each first divergence is
classified by a teacher-forced forward of the reference tokens. If the two competing tokens are
both within the tolerance of the top logit there (``tie_tolerance``; in float32 at most
:data:`FLOAT32_TIE_TOLERANCE`), it is a rounding tie (still lossless); anything else is a bug.
After a first divergence the rest of the output is not comparable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from jetflow.core.target import Target

DivergenceKind = Literal["tie", "bug"]

#: bf16/fp16: the largest logit gap at a divergence that still counts as a rounding tie. bf16
#: logits of SmolLM2 are ~20 in size, so they step by 0.125; one forward versus 16-token chunks
#: of the same tokens moved them by up to 0.94 (mean 0.12).
DEFAULT_TIE_TOLERANCE = 1.0
#: float32: the largest logit gap of a rounding tie. Kernels that sum in another order move fp32
#: logits of ~20 by ~1e-5 relative, so a gap of 0.01 is fifty times what rounding can explain
FLOAT32_TIE_TOLERANCE = 0.01


@dataclass(frozen=True)
class Divergence:
    """The first position where a method's tokens leave the reference's.

    Attributes:
        sample_id: the data set sample.
        turn: 0-based user turn (MT-Bench has two).
        position: index into the new tokens.
        expected: the reference's token there, None if the reference had ended.
        got: the method's token there, None if the method had ended.
        logit_gap: top logit minus the lower logit of ``expected`` and ``got``, from a
            teacher-forced forward of the reference; None when one side had ended.
        kind: ``tie`` (rounding, still lossless) or ``bug`` (a real divergence).
    """

    sample_id: str
    turn: int
    position: int
    expected: int | None
    got: int | None
    logit_gap: float | None
    kind: DivergenceKind

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def first_divergence(reference: Sequence[int], candidate: Sequence[int]) -> int | None:
    """Index of the first differing token; a length difference counts at the shorter end."""
    shared = min(len(reference), len(candidate))
    differs = torch.tensor(reference[:shared]) != torch.tensor(candidate[:shared])
    if bool(differs.any()):
        return int(differs.int().argmax())
    return None if len(reference) == len(candidate) else shared


class LosslessChecker:
    """Compares outputs with the reference, exactly in fp32 and by tie classification otherwise."""

    def __init__(self, target: Target, tie_tolerance: float) -> None:
        self.target = target
        fp32 = target.dtype == torch.float32
        self.tie_tolerance = min(tie_tolerance, FLOAT32_TIE_TOLERANCE) if fp32 else tie_tolerance
        # compiled kernels and packed fp32 weights round differently per row count: classify there
        self.exact = fp32 and target.compiled is None and target.linear_weights == "plain"

    def check(
        self,
        sample_id: str,
        turn: int,
        prompt_ids: Sequence[int],
        reference: Sequence[int],
        candidate: Sequence[int],
    ) -> Divergence | None:
        """None when ``candidate`` equals ``reference``, else its classified first divergence."""
        position = first_divergence(reference, candidate)
        if position is None:
            return None
        expected = reference[position] if position < len(reference) else None
        got = candidate[position] if position < len(candidate) else None
        gap = None
        if expected is not None and got is not None:
            gap = self.logit_gap(prompt_ids, reference[:position], expected, got)
        tie = not self.exact and gap is not None and gap <= self.tie_tolerance
        return Divergence(sample_id, turn, position, expected, got, gap, "tie" if tie else "bug")

    @torch.inference_mode()
    def logit_gap(self, prompt_ids: Sequence[int], prefix: Sequence[int], first: int, second: int) -> float:
        """How far the lower of two tokens sits below the top logit after ``prompt + prefix``."""
        ids = torch.tensor([[*prompt_ids, *prefix]], dtype=torch.long, device=self.target.device)
        logits = self.target.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
        pair = logits[torch.tensor([first, second], device=logits.device)]
        return float(logits.max() - pair.min())
