"""Drafting against plain decoding per batch size: ``pytest --benchmark tests/bench/test_batch_speedup.py``.

The paper's batch figure at the size of a test. The shipped head, with its budget left to jetflow
(the first-use calibration, re-priced for the rows of each step by the adaptive budget: the more
rows a forward holds, the fewer nodes pay), and plain decoding each decode the same prompts, B at
a time, alternating in one process, ``ar`` first. The result is the ratio of their times: a
ratio, never a time, is asserted, as loose as the budget-0 benchmark's (``test_budget_zero``):
where trees stop paying, the budget must fall back toward plain decoding, not lose to it. Each
sequence's tokens must be ``ar``'s, but for divergences the bench's checker calls rounding
(batching and trees change the packed fp32 GEMMs' shapes).
"""

from __future__ import annotations

import statistics
import time

import pytest
from jetflow.bench.lossless import DEFAULT_TIE_TOLERANCE, LosslessChecker
from jetflow.core.calibration import ensure_calibration
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.result import GenerationResult
from jetflow.core.target import Target

PROMPTS = (
    "Explain in three short paragraphs why the sky looks blue in the day and red at sunset.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "List five tips for writing clear emails at work, one sentence each.",
    "What is the difference between a list and a tuple in Python? Give an example of each.",
    "Describe how a bicycle's gears make it easier to ride uphill.",
    "Write a haiku about autumn leaves, then explain its imagery in two sentences.",
    "Summarise the plot of Romeo and Juliet in four sentences.",
    "Give step-by-step instructions for making a cup of tea.",
)
BATCH_SIZES = (1, 4, 8)
MAX_NEW_TOKENS = 64
ROUNDS = 3
#: the drafted engine's least speed against batched ar's at the same batch size (as test_budget_zero)
FLOOR = 0.97


@pytest.fixture(autouse=True)
def _needs_flag(request: pytest.FixtureRequest) -> None:
    if not request.config.getoption("jetflow_benchmark", default=False):
        pytest.skip("benchmark: run with --benchmark")


@pytest.fixture(scope="module")
def engines(real_target: Target) -> tuple[Engine, Engine]:
    """Plain decoding and the shipped head with the budget left to jetflow (calibrated once here)."""
    config = build_config(GenerateConfig, {"drafter": "jetflow", "max_new_tokens": MAX_NEW_TOKENS})
    ensure_calibration(config, real_target, progress=False)
    drafted = Engine(config, real_target)
    plain = Engine(config.model_copy(update={"drafter": "none"}), real_target)
    assert drafted.adaptive is not None and plain.drafter is None
    return plain, drafted


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_drafting_keeps_up_with_batched_ar(
    benchmark, real_target: Target, engines: tuple[Engine, Engine], batch_size: int
) -> None:
    plain, drafted = engines
    for engine in (plain, drafted):  # warm-up: the kernels' first calls at this batch's shapes
        engine.generate_batch(list(PROMPTS[:batch_size]), max_new_tokens=8, batch_size=batch_size)
    seconds: dict[str, list[float]] = {"ar": [], "drafted": []}
    outputs: dict[str, list[GenerationResult]] = {}

    def one_round() -> None:
        for name, engine in (("ar", plain), ("drafted", drafted)):
            start = time.perf_counter()
            outputs[name] = engine.generate_batch(list(PROMPTS), batch_size=batch_size)
            seconds[name].append(time.perf_counter() - start)

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    ratio = statistics.median(seconds["ar"]) / statistics.median(seconds["drafted"])
    steps = [step for result in outputs["drafted"] for step in result.steps]
    forwards = sum(1 / step.rows for step in steps)
    tokens = sum(result.new_tokens for result in outputs["drafted"])
    benchmark.extra_info.update(
        batch_size=batch_size,
        speed_vs_ar=round(ratio, 3),
        tau=round(tokens / len(steps), 3),
        mean_batch_budget=round(sum(step.batch_budget / step.rows for step in steps) / forwards, 2),
    )
    checker = LosslessChecker(real_target, DEFAULT_TIE_TOLERANCE)
    divergences = [
        checker.check(str(index), 0, ar.prompt_ids, ar.token_ids, result.token_ids)
        for index, (ar, result) in enumerate(zip(outputs["ar"], outputs["drafted"], strict=True))
    ]
    bugs = [divergence for divergence in divergences if divergence is not None and divergence.kind == "bug"]
    assert not bugs, f"batch {batch_size}: drafted rows diverge from ar: {bugs}"
    assert ratio >= FLOOR, f"batch {batch_size}: drafting ran at {ratio:.3f}x batched ar"
