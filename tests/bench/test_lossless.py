"""Lossless check: first divergences, exact in fp32, rounding ties versus bugs in bf16."""

from __future__ import annotations

import math

import pytest
import torch
from jetflow.bench import lossless
from jetflow.bench.lossless import FLOAT32_TIE_TOLERANCE, LosslessChecker, first_divergence
from jetflow.core.target import Target

from tests.bench.conftest import chat_target, words


@pytest.mark.parametrize(
    ("reference", "candidate", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 3], [1, 9, 3], 1),
        ([1, 2, 3], [9, 9, 9], 0),
        ([1, 2, 3], [1, 2], 2),
        ([1, 2], [1, 2, 3], 2),
        ([], [], None),
        ([], [4], 0),
    ],
)
def test_first_divergence(reference: list[int], candidate: list[int], expected: int | None) -> None:
    assert first_divergence(reference, candidate) == expected


def _runner_up(target: Target, prompt: list[int], prefix: list[int]) -> tuple[int, int, float]:
    """Top-1 and top-2 tokens after ``prompt + prefix`` and their logit gap, teacher-forced."""
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([prompt + prefix])).logits[0, -1].float()
    top = logits.topk(2)
    return int(top.indices[0]), int(top.indices[1]), float(top.values[0] - top.values[1])


@pytest.fixture(scope="module")
def bf16_target() -> Target:
    target = chat_target()
    target.model.to(torch.bfloat16)
    return target


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_swap_to_the_runner_up_is_classified_by_its_gap(
    bench_target: Target, bf16_target: Target, dtype: str
) -> None:
    target = bench_target if dtype == "float32" else bf16_target
    prompt = target.encode_prompt(words(7, 8, 9, 10, 11))
    reference = [int(t) for t in _greedy(target, prompt, 6)]
    best, second, gap = _runner_up(target, prompt, reference[:3])
    assert best == reference[3]
    candidate = [*reference[:3], second, 5, 5]

    loose = LosslessChecker(target, tie_tolerance=math.inf).check("s", 0, prompt, reference, candidate)
    strict = LosslessChecker(target, tie_tolerance=0.0).check("s", 0, prompt, reference, candidate)
    for divergence in (loose, strict):
        assert (divergence.position, divergence.expected, divergence.got) == (3, best, second)
        assert divergence.logit_gap == pytest.approx(gap, abs=1e-4)
    # fp32 is exact: any mismatch is a bug, whatever the tolerance.
    assert loose.kind == ("bug" if dtype == "float32" else "tie")
    assert strict.kind == "bug"


def test_fp32_on_packed_weights_classifies_with_the_fp32_tolerance(bench_target: Target, monkeypatch) -> None:
    """Packed fp32 weights round differently per row count, so divergences are classified there,
    but a gap wider than fp32 rounding can explain stays a bug."""
    monkeypatch.setattr(bench_target, "linear_weights", "packed")
    prompt = bench_target.encode_prompt(words(7, 8, 9, 10, 11))
    reference = [int(t) for t in _greedy(bench_target, prompt, 6)]
    _, second, gap = _runner_up(bench_target, prompt, reference[:3])
    candidate = [*reference[:3], second, 5, 5]
    checker = LosslessChecker(bench_target, tie_tolerance=math.inf)
    assert not checker.exact and checker.tie_tolerance == FLOAT32_TIE_TOLERANCE
    assert checker.check("s", 0, prompt, reference, candidate).kind == ("tie" if gap <= 0.01 else "bug")
    monkeypatch.setattr(lossless, "FLOAT32_TIE_TOLERANCE", math.inf)
    assert LosslessChecker(bench_target, math.inf).check("s", 0, prompt, reference, candidate).kind == "tie"


def test_identical_outputs_pass_and_an_early_stop_is_a_bug(bf16_target: Target) -> None:
    checker = LosslessChecker(bf16_target, tie_tolerance=math.inf)
    assert checker.check("s", 0, [5, 6], [3, 4, 5], [3, 4, 5]) is None
    stopped = checker.check("s", 1, [5, 6], [3, 4, 5], [3, 4])
    assert (stopped.position, stopped.expected, stopped.got, stopped.logit_gap) == (2, 5, None, None)
    assert stopped.kind == "bug" and stopped.as_dict()["turn"] == 1


def _greedy(target: Target, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = target.model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n
        )
    return out[0, len(prompt) :].tolist()
