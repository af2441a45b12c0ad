"""The cost model: the budget choice, the keyed cache, and how the engine resolves ``auto``.

Measured times are never asserted (the machine is shared); the choice is checked against the
model's own arithmetic, and the engine against hand-written calibration records.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from jetflow.core import calibration as cal
from jetflow.core.config import DEFAULT_BUDGET, GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.errors import ConfigError
from jetflow.core.target import Target
from scipy.optimize import isotonic_regression

from tests.conftest import make_tiny_target
from tests.drafters.tiny_heads import save_head, tiny_head

PROMPTS = ([7, 8, 9, 10, 11] * 3 + [7], [3, 4, 5, 6, 3, 4, 5, 6, 3])


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path))


def _config(**fields) -> GenerateConfig:
    return build_config(GenerateConfig, {"drafter": "ngram", "chat_template": False, **fields})


def _key(target: Target, **fields) -> cal.CalibrationKey:
    return cal.key_for(_config(**fields), target)


def _record(key: cal.CalibrationKey, budget: int = 3) -> cal.Calibration:
    """A hand-written calibration whose best budget is ``budget`` (one of 1, ``budget``, 9)."""
    points = [
        cal.BudgetPoint(
            budget=b,
            tau=speed / 100,
            draft_ms=4.0,
            verify_ms=6.0,
            mean_tree_size=b,
            expected_tokens_per_s=speed,
        )
        for b, speed in ((1, 100.0), (budget, 300.0), (9, 200.0))
    ]
    return cal.Calibration(
        key=key,
        created="2026-01-01T00:00:00+00:00",
        tree_sizes=[1, 10],
        verify_latency_ms=[2.0, 3.0],
        points=points,
        budget=budget,
        baseline_tokens_per_s=500.0,
        n_prompts=1,
        max_new_tokens=8,
        repeats=1,
    )


# ---------------------------------------------------------------------- the model
def test_the_choice_is_the_argmax_of_tau_over_step_cost() -> None:
    budgets = [1, 4, 16, 64]
    tau = [1.2, 2.0, 3.0, 3.3]
    draft_s = [0.001, 0.001, 0.002, 0.004]
    verify_s = [0.010, 0.012, 0.020, 0.060]
    speeds = cal.expected_tokens_per_s(tau, draft_s, verify_s)
    np.testing.assert_allclose(speeds, [1.2 / 0.011, 2.0 / 0.013, 3.0 / 0.022, 3.3 / 0.064])
    assert cal.choose_budget(budgets, speeds) == 4
    # Flat draft and verify costs (a GPU's) move the choice up: 3.3 / 0.012 beats 3.0 / 0.011.
    flat = cal.expected_tokens_per_s(tau, [0.001] * 4, [0.010, 0.010, 0.010, 0.011])
    assert cal.choose_budget(budgets, flat) == 64


def test_the_choice_matches_brute_force_on_random_curves_and_prefers_small_on_ties() -> None:
    rng = np.random.default_rng(0)
    budgets = [1, 2, 4, 8, 16, 32]
    for _ in range(50):
        speeds = rng.uniform(1, 100, size=len(budgets))
        shuffled = rng.permutation(len(budgets))
        chosen = cal.choose_budget([budgets[i] for i in shuffled], speeds[shuffled])
        assert chosen == budgets[int(np.argmax(speeds))]
    assert cal.choose_budget([8, 2, 4], [5.0, 5.0, 1.0]) == 2
    with pytest.raises(ValueError):
        cal.choose_budget([1, 2], [1.0])


def test_latency_is_interpolated_between_grid_sizes_and_clamped() -> None:
    got = cal.interpolate_latency([1, 8, 16], [0.01, 0.02, 0.04], [1, 4.5, 12, 16, 40])
    np.testing.assert_allclose(got, [0.01, 0.015, 0.03, 0.04, 0.04])


@pytest.mark.parametrize(
    ("speeds", "stop"),
    [
        ([10.0, 20.0], False),  # too few budgets to tell
        ([10.0, 20.0, 15.0, 15.0], True),  # two in a row below 80% of the best
        ([10.0, 20.0, 15.0, 19.0], False),  # the last one is back near the best
        ([10.0, 20.0, 30.0], False),  # still rising
    ],
)
def test_the_search_stops_two_budgets_past_the_peak(speeds: list[float], stop: bool) -> None:
    assert cal.past_the_peak(speeds) is stop


# ---------------------------------------------------------------------- measuring
@pytest.fixture(scope="module")
def measured() -> tuple[Target, cal.Calibration]:
    torch.manual_seed(0)
    target = make_tiny_target("llama")
    config = build_config(GenerateConfig, {"drafter": "ngram", "chat_template": False})
    calibration = cal.calibrate(
        config, target, prompts=PROMPTS, budgets=[4, 1, 2], max_new_tokens=12, repeats=1, warmup=0
    )
    return target, calibration


def test_a_calibration_measures_every_budget_and_picks_its_best(measured) -> None:
    target, calibration = measured
    assert [p.budget for p in calibration.points] == [0, 1, 2, 4]  # 0: no drafting, always a candidate
    assert calibration.tree_sizes[0] == 1 and calibration.tree_sizes[-1] == 5
    assert all(t > 0 for t in calibration.verify_latency_ms)
    baseline = calibration.points[0]
    assert (baseline.tau, baseline.draft_ms, baseline.mean_tree_size) == (1.0, 0.0, 1.0)
    assert baseline.expected_tokens_per_s == calibration.baseline_tokens_per_s
    for point in calibration.points:
        assert 1.0 <= point.tau <= 1 + point.budget
        assert 1.0 <= point.mean_tree_size <= 1 + point.budget
        assert point.expected_tokens_per_s == pytest.approx(
            point.tau / ((point.draft_ms + point.verify_ms) / 1e3), rel=1e-3
        )
    speeds = calibration.expected_tokens_per_s
    assert set(speeds) == {"0", "1", "2", "4"}
    # the smallest budget within the tolerance of the fastest (the argmax only when none is close)
    fastest = max(speeds.values())
    close = [int(b) for b, v in speeds.items() if v >= (1 - cal.CHOICE_TOLERANCE) * fastest]
    assert calibration.budget == min(close)
    assert str(calibration.budget) in calibration.reason()
    assert calibration.key == _key(target)


def test_the_cache_round_trips_and_is_keyed(measured) -> None:
    target, calibration = measured
    path = cal.save_calibration(calibration)
    assert path.parent.name == "calibration" and json.loads(path.read_text())["budget"] == calibration.budget
    assert cal.load_calibration(_key(target)) == calibration
    other_setups = [
        _key(target, drafter_params={"max_ngram": 2}),
        _key(target, tree={"policy": "chain"}),
        _key(target, tree={"width": 2}),
        _key(make_tiny_target("qwen3")),
    ]
    for key in other_setups:
        assert key != calibration.key
        assert cal.load_calibration(key) is None
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert cal.load_calibration(_key(target)) is None
    finally:
        torch.set_num_threads(threads)


def test_a_learned_drafter_is_keyed_by_its_weights_not_only_its_folder(tiny_llama: Target, tmp_path) -> None:
    folder = tmp_path / "head"
    params = {"drafter": "jetflow", "drafter_params": {"checkpoint": str(folder)}}
    save_head(folder, tiny_llama, tiny_head(tiny_llama, seed=0))
    first = _key(tiny_llama, **params)
    assert first.drafter_weights and _key(tiny_llama, **params) == first
    save_head(folder, tiny_llama, tiny_head(tiny_llama, seed=1))  # retrained into the same folder
    assert _key(tiny_llama, **params) != first
    assert _key(tiny_llama).drafter_weights is None  # ngram has no weights


def test_calibration_needs_a_drafter_and_valid_budgets(tiny_llama: Target) -> None:
    with pytest.raises(ConfigError, match="needs a drafter"):
        cal.calibrate(_config(drafter="none"), tiny_llama, prompts=PROMPTS)
    with pytest.raises(ConfigError, match="budgets"):
        cal.calibrate(_config(), tiny_llama, prompts=PROMPTS, budgets=[0, 2])


# ---------------------------------------------------------------------- the engine's budget
def test_auto_and_unset_budgets_resolve_to_the_calibrated_integer(tiny_llama: Target) -> None:
    cal.save_calibration(_record(_key(tiny_llama), budget=3))
    for budget in ("auto", None):
        tree = {} if budget is None else {"budget": budget}
        engine = Engine.from_cache(_config(tree=tree | {"adapt": False}), tiny_llama)
        assert (engine.budget, engine.budget_source) == (3, "calibrated")
        result = engine.generate(PROMPTS[0], max_new_tokens=6)
        assert result.stats()["budget"] == 3
        assert max(step.tree_size for step in result.steps) <= 4
        adaptive = Engine.from_cache(_config(tree=tree), tiny_llama)  # the default: re-chosen every step
        assert (adaptive.budget, adaptive.budget_source) == (3, "adaptive")
        assert adaptive.generate(PROMPTS[0], max_new_tokens=6).steps[0].budget == 3
    fixed = Engine.from_cache(_config(tree={"budget": 5}), tiny_llama)
    assert (fixed.budget, fixed.budget_source) == (5, "fixed")
    assert fixed.generate(PROMPTS[0], max_new_tokens=4).stats()["budget"] == 5


def test_the_engine_takes_its_calibration_from_the_caller_and_reads_no_cache(tiny_llama: Target) -> None:
    """Only :meth:`Engine.from_cache` looks in the cache: the constructor runs from the calibration
    it is handed, and refuses one measured for another setup."""
    record = _record(_key(tiny_llama), budget=3)
    cal.save_calibration(record)
    unhanded = Engine(_config(), tiny_llama)
    assert (unhanded.budget, unhanded.budget_source) == (DEFAULT_BUDGET, "default")
    with pytest.raises(ConfigError, match=r"Engine\.from_cache") as error:
        Engine(_config(tree={"budget": "auto"}), tiny_llama)
    assert "\n" not in str(error.value)
    cal.calibration_path(record.key).unlink()  # nothing cached now
    for budget in ("auto", None):
        tree = {"adapt": False} | ({} if budget is None else {"budget": budget})
        handed = Engine(_config(tree=tree), tiny_llama, calibration=record)
        assert (handed.budget, handed.budget_source) == (3, "calibrated")
    other = _record(_key(tiny_llama, tree={"width": 3}), budget=3)
    with pytest.raises(ConfigError, match=r"measured for .* not for this engine's") as error:
        Engine(_config(), tiny_llama, calibration=other)
    assert "\n" not in str(error.value)


def test_without_a_calibration_unset_is_the_default_and_auto_says_what_to_run(tiny_llama: Target) -> None:
    cal.save_calibration(_record(_key(tiny_llama, tree={"policy": "chain"})))  # another setup
    engine = Engine.from_cache(_config(), tiny_llama)
    assert (engine.budget, engine.budget_source) == (DEFAULT_BUDGET, "default")
    with pytest.raises(ConfigError) as error:
        Engine.from_cache(_config(tree={"budget": "auto"}), tiny_llama)
    message = str(error.value)
    assert "jetflow calibrate --drafter ngram --tree-policy best-first" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "unreadable"),
        ('{"version": 0, "budget": 8}', "schema version 0"),
        (json.dumps({"version": cal.SCHEMA_VERSION, "budget": "eight"}), "invalid at"),
        ("other-key", "another setup"),
    ],
)
def test_an_unusable_cache_file_is_a_clear_error_for_auto_and_ignored_when_unset(
    tiny_llama: Target, content: str, message: str
) -> None:
    key = _key(tiny_llama)
    path = cal.calibration_path(key)
    path.parent.mkdir(parents=True)
    if content == "other-key":
        content = _record(_key(tiny_llama, tree={"width": 3})).model_dump_json()
    path.write_text(content)
    with pytest.raises(ConfigError, match=message) as error:
        cal.load_calibration(key)
    assert "jetflow calibrate --force" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=message):
        Engine.from_cache(_config(tree={"budget": "auto"}), tiny_llama)
    assert Engine.from_cache(_config(), tiny_llama).budget == DEFAULT_BUDGET


@pytest.mark.parametrize("bad", ["bad", "-1", -3, 2.5, True, ""])
def test_a_bad_budget_is_a_one_line_config_error(bad) -> None:
    with pytest.raises(
        ConfigError, match=r"tree\.budget: .*integer >= 0 \(0: no drafting\) or 'auto'"
    ) as error:
        build_config(GenerateConfig, {"tree": {"budget": bad}})
    assert "\n" not in str(error.value)


def test_budget_accepts_integers_their_text_and_auto() -> None:
    def budget(value):
        return build_config(GenerateConfig, {"tree": {"budget": value}}).tree.budget

    assert (budget(12), budget("12"), budget("auto"), budget(" Auto ")) == (12, 12, "auto", "auto")
    assert budget(0) == budget("0") == 0
    assert build_config(GenerateConfig, {}).tree.budget is None


def test_where_no_tree_pays_the_choice_is_budget_0_and_the_engine_then_never_drafts(
    tiny_llama: Target,
) -> None:
    slow_trees = [
        cal.BudgetPoint(
            budget=b, tau=1.2, draft_ms=5, verify_ms=12, mean_tree_size=b + 1, expected_tokens_per_s=70.6
        )
        for b in (1, 2)
    ]
    baseline = cal.no_drafting_point(0.010)
    speeds = [p.expected_tokens_per_s for p in (baseline, *slow_trees)]
    assert baseline.expected_tokens_per_s == 100.0
    assert cal.choose_budget([0, 1, 2], speeds) == 0

    def never(_context):
        raise AssertionError("the drafter must not be asked at budget 0")

    engine = Engine(_config(tree={"budget": 0}), tiny_llama)
    engine.drafter.begin = never
    plain = Engine(build_config(GenerateConfig, {"drafter": "none", "chat_template": False}), tiny_llama)
    result = engine.generate([5, 6, 7], max_new_tokens=8)
    assert result.token_ids == plain.generate([5, 6, 7], max_new_tokens=8).token_ids
    assert engine.budget == 0 and {step.tree_size for step in result.steps} == {1}


def test_predictions_within_the_tolerance_count_as_equal_and_the_smaller_budget_wins() -> None:
    budgets, speeds = [0, 1, 2, 4], [15.1, 15.55, 13.1, 10.9]  # a loaded CPU's calibration
    assert cal.choose_budget(budgets, speeds) == 1
    assert cal.choose_budget(budgets, speeds, tolerance=cal.CHOICE_TOLERANCE) == 0
    assert cal.choose_budget([0, 64, 128], [10.0, 30.0, 31.0], tolerance=0.05) == 64
    assert cal.choose_budget([0, 64, 128], [10.0, 28.0, 31.0], tolerance=0.05) == 128


# ---------------------------------------------------------------------- first use
def test_first_use_measures_once_caches_and_the_engine_then_adapts(tiny_llama: Target) -> None:
    config = _config(max_new_tokens=8)
    lines: list[str] = []
    first = cal.ensure_calibration(config, tiny_llama, progress=False, announce=lines.append)
    assert first is not None and len(lines) == 1 and "first use" in lines[0]
    assert {p.budget for p in first.points} >= {0, 1}  # plain decoding is always a candidate
    assert max(p.budget for p in first.points) <= max(cal.FIRST_USE_BUDGETS)
    assert cal.calibration_path(first.key).is_file()
    again = cal.ensure_calibration(config, tiny_llama, progress=False, announce=lines.append)
    assert again == first and len(lines) == 1  # read from the cache, nothing announced
    engine = Engine.from_cache(config, tiny_llama)
    assert engine.budget_source == "adaptive" and engine.adaptive is not None


def test_first_use_leaves_fixed_budgets_and_plain_decoding_alone(tiny_llama: Target) -> None:
    lines: list[str] = []
    for config in (_config(tree={"budget": 4}), _config(drafter="none")):
        assert cal.ensure_calibration(config, tiny_llama, progress=False, announce=lines.append) is None
    assert lines == []


def test_batch_steps_are_priced_as_the_default_split_drafts_them(measured, monkeypatch) -> None:
    """A share's price includes the best-first allocation's drafting (rows drafted past their
    share, then cut back): the engine's default, and never cheaper than an equal split."""
    target, _ = measured
    splits: list[str] = []
    build = Engine._assemble

    def recording(self, config, *args):
        splits.append(config.tree.split)
        build(self, config, *args)

    monkeypatch.setattr(Engine, "_assemble", recording)
    config = build_config(
        GenerateConfig, {"drafter": "ngram", "chat_template": False, "tree": {"split": "equal"}}
    )
    cal.measure_batch_point(config, target, [0, 2], 2, PROMPTS, rounds=1, max_new_tokens=4)
    assert splits == ["best-first", "best-first"]


def test_batch_step_costs_are_measured_per_budget_and_price_a_batch(measured) -> None:
    """``batch_sizes`` measures a step of that many rows at every budget; the adaptive budget
    then prices steps of those rows from them (and past them on the slope of the last two)."""
    target, calibration = measured
    config = build_config(GenerateConfig, {"drafter": "ngram", "chat_template": False})
    batched = cal.with_batches(calibration, config, target, [1, 3, 2], prompts=PROMPTS)
    assert [batch.rows for batch in batched.batches] == [2, 3]
    for batch in batched.batches:
        assert batch.budgets == [point.budget for point in calibration.points]
        assert all(ms > 0 for ms in batch.verify_ms) and batch.draft_ms[0] == pytest.approx(0.0, abs=0.5)
    assert cal.with_batches(batched, config, target, [2, 3]) is batched  # nothing missing: no work
    assert "2" in batched.summary()["batch_step_ms"]
    from jetflow.core.adaptive import AdaptiveBudget

    controller = AdaptiveBudget.from_calibration(batched)
    single = [(p.draft_ms + p.verify_ms) / 1e3 for p in calibration.points]
    by_rows = np.array([single, *(np.array(batch.step_ms) / 1e3 for batch in batched.batches)])
    # the measured costs, fitted non-decreasing in the rows per budget (a tie is pooled)
    fitted = np.stack([isotonic_regression(column, increasing=True).x for column in by_rows.T], axis=1)
    assert np.all(np.diff(fitted, axis=0) >= 0)
    controller.next_budget(rows=3)
    assert controller.cost_s == pytest.approx(fitted[2])
    controller.next_budget(rows=1)
    assert controller.cost_s == pytest.approx(single)
