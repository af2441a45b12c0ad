"""Budget 0 costs what plain decoding costs: ``pytest --benchmark tests/bench/test_budget_zero.py``.

Where no tree pays (a processor whose small-tree verify costs far more than a step), a drafted
engine's adaptive budget sits at 0. It then decodes exactly what plain decoding decodes, and all
it may do beyond it is keep the drafter's features and probe a larger budget now and then. Both
engines decode the same prompt in one process, alternating, ``ar`` first, and the benchmark's
result is the ratio of their times: a ratio, never a time, is asserted.
"""

from __future__ import annotations

import statistics

import pytest
from jetflow.core import calibration as cal
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.target import Target

from tests.core.test_adaptive import calibration_record

PROMPT = "Explain in three short paragraphs why the sky looks blue in the day and red at sunset."
MAX_NEW_TOKENS = 128
ROUNDS = 3
#: a budget-0 run's least speed against ar's: what feature capture and rare probes may cost
FLOOR = 0.97
#: step costs (ms) of a machine where no tree pays: every budget's tau / cost falls below
#: plain decoding's 1 / 50 even at the shipped head's real acceptance, so probes never win
COST_MS = {0: 50.0, 1: 90.0, 2: 100.0, 4: 110.0}
TAU = {0: 1.0, 1: 1.3, 2: 1.4, 4: 1.5}


@pytest.fixture(autouse=True)
def _needs_flag(request: pytest.FixtureRequest) -> None:
    if not request.config.getoption("jetflow_benchmark", default=False):
        pytest.skip("benchmark: run with --benchmark")


def test_a_drafted_engine_at_budget_zero_decodes_at_plain_speed(benchmark, real_target: Target) -> None:
    fields = {"drafter": "jetflow", "max_new_tokens": MAX_NEW_TOKENS, "tree": {"budget": "auto"}}
    config = build_config(GenerateConfig, fields)
    cal.save_calibration(calibration_record(cal.key_for(config, real_target), TAU, COST_MS))
    drafted = Engine(config, real_target)
    plain = Engine(config.model_copy(update={"drafter": "none"}), real_target)
    assert drafted.adaptive is not None and drafted.adaptive.choice == 0 and plain.drafter is None
    for engine in (plain, drafted):  # warm-up: the kernels' first calls
        engine.generate(PROMPT, max_new_tokens=8)
    seconds: dict[str, list[float]] = {"ar": [], "drafted": []}
    tokens: dict[str, list[int]] = {}
    probes: list[int] = []

    def one_round() -> None:
        for name, engine in (("ar", plain), ("drafted", drafted)):
            result = engine.generate(PROMPT)
            seconds[name].append(result.wall_s)
            tokens[name] = result.token_ids
        probes.append(sum(step.tree_size > 1 for step in result.steps))

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    ratio = statistics.median(seconds["ar"]) / statistics.median(seconds["drafted"])
    benchmark.extra_info.update(speed_vs_ar=round(ratio, 3), probes_per_round=probes)
    assert tokens["drafted"] == tokens["ar"]
    assert drafted.adaptive.choice == 0  # nothing paid, as the costs promise
    assert ratio >= FLOOR, f"budget 0 ran at {ratio:.3f}x ar (probes per round: {probes})"
