"""``auto`` among the bench budgets: run under its own method name, reported by the budgets it used."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from jetflow.bench.config import BenchConfig, load_bench_config
from jetflow.bench.generation import Generation
from jetflow.bench.methods import auto_configs, build_methods
from jetflow.bench.metrics import TurnRecord, summarise
from jetflow.bench.report import budget_label
from jetflow.core import calibration as cal
from jetflow.core.config import GenerateConfig
from jetflow.core.errors import ConfigError
from jetflow.core.target import Target

from tests.core.test_calibration import _record


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path))


def test_auto_runs_beside_the_fixed_budgets_under_its_own_name(bench_target: Target) -> None:
    key = cal.key_for(GenerateConfig(drafter="ngram"), bench_target)
    cal.save_calibration(_record(key, budget=3))
    config = load_bench_config(None, {"drafters": ["ngram"], "budgets": ["auto", "4"], "baselines": []})
    lineup = [(m.name, m.budget, m.policy) for m in build_methods(config, bench_target)]
    assert lineup == [("ar", None, None), ("ngram@auto", 3, "best-first"), ("ngram", 4, "best-first")]


def test_auto_without_a_calibration_says_what_to_run(bench_target: Target) -> None:
    config = load_bench_config(None, {"drafters": ["ngram"], "budgets": ["auto"], "baselines": []})
    with pytest.raises(ConfigError, match="jetflow calibrate --drafter ngram"):
        build_methods(config, bench_target)


@pytest.mark.parametrize(("budgets", "message"), [(["auto", "auto"], "listed twice"), (["x"], "budgets.0")])
def test_bad_budget_lists_are_config_errors(budgets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_bench_config(None, {"budgets": budgets})


def test_an_adaptive_run_is_named_by_its_most_used_budget_and_shows_the_mix() -> None:
    def generation(budgets: tuple[int, ...]) -> Generation:
        return Generation((5,) * len(budgets), 1.0, len(budgets), 0.1, 0.9, (0,) * len(budgets), budgets)

    method = SimpleNamespace(name="ngram@auto", budget=0, policy="best-first")
    records = [TurnRecord("a", 0, (1,), generation((0, 0, 2))), TurnRecord("b", 0, (1,), generation((2, 2)))]
    run = summarise(method, "champ", "float32", records, ar_tokens_per_s=2.5)
    assert (run["budget"], run["budget_histogram"]) == (2, {"0": 2, "2": 3})
    assert budget_label(run) == "2 (adaptive; 0: 40%, 2: 60%)"
    fixed = summarise(
        SimpleNamespace(name="ngram", budget=4, policy="best-first"),
        "champ",
        "float32",
        [TurnRecord("a", 0, (1,), generation((4, 4)))],
        ar_tokens_per_s=2.5,
    )
    assert (fixed["budget"], budget_label(fixed)) == (4, "4")


def _auto_config(config: BenchConfig, method: str) -> GenerateConfig:
    """The engine configuration of ``method``'s auto run."""
    (found,) = [
        c for c, spec in zip(auto_configs(config), config.drafter_specs, strict=True) if spec.method == method
    ]
    return found


def test_the_bench_measures_the_calibrations_its_auto_runs_lack(
    bench_target: Target, prompt_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jetflow.bench import methods
    from jetflow.bench.runner import run_benchmark

    measured: list[cal.CalibrationKey] = []

    def calibrate(config: GenerateConfig, target: Target, **_) -> cal.Calibration:
        key = cal.key_for(config, target)
        measured.append(key)
        return _record(key, budget=3)

    monkeypatch.setattr(methods, "calibrate", calibrate)
    fields = {"drafters": ["ngram", "ngram:chain"], "budgets": ["auto", "4"], "baselines": []}
    config = load_bench_config(None, fields | {"datasets": [f"file:{prompt_file}"], "max_new_tokens": 4})
    chain = cal.key_for(_auto_config(config, "ngram:chain"), bench_target)
    cal.save_calibration(_record(chain, budget=2))  # cached already: kept

    results = run_benchmark(config, target=bench_target)
    assert [key.policy for key in measured] == ["best-first"]
    assert [(run["method"], run["budget"]) for run in results.runs if "@" in run["method"]] == [
        ("ngram@auto", 3),
        ("ngram:chain@auto", 2),
    ]
    assert methods.calibrate_auto_runs(config, bench_target) == [], "measured once, then cached"


def test_a_resumed_bench_starts_its_auto_runs_from_the_calibrations_kept_with_its_results(
    bench_target: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from jetflow.bench import methods

    monkeypatch.setattr(
        methods, "calibrate", lambda config, target, **_: _record(cal.key_for(config, target), 5)
    )
    config = load_bench_config(None, {"drafters": ["ngram"], "budgets": ["auto"], "baselines": []})
    key = cal.key_for(_auto_config(config, "ngram"), bench_target)
    kept = tmp_path / "results" / "calibration"
    cal.save_calibration(_record(key, budget=3))
    assert methods.calibrate_auto_runs(config, bench_target, kept=kept) == []
    cal.save_calibration(_record(key, budget=2))  # a later session measured its own

    methods.calibrate_auto_runs(config, bench_target, kept=kept)  # a new run: the machine's own
    assert cal.load_calibration(key).budget == 2
    methods.calibrate_auto_runs(config, bench_target, kept=kept / "other", resume=True)
    assert cal.load_calibration(key).budget == 2, "nothing kept there: the machine's own"
    (kept / cal.calibration_path(key).name).write_text(_record(key, budget=3).model_dump_json())
    methods.calibrate_auto_runs(config, bench_target, kept=kept, resume=True)
    assert cal.load_calibration(key).budget == 3, "a resume: the one its results started from"

    (kept / cal.calibration_path(key).name).write_text("{")
    with caplog.at_level("WARNING"):
        methods.calibrate_auto_runs(config, bench_target, kept=kept, resume=True)
    assert "not a usable calibration record" in caplog.text
    assert cal.load_calibration(key).budget == 3
    assert (
        cal.Calibration.model_validate_json((kept / cal.calibration_path(key).name).read_text()).budget == 3
    )


def test_with_a_batch_axis_the_auto_calibrations_hold_the_step_costs_of_its_batch_sizes(
    bench_target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cached calibration without batched step costs (a plain `jetflow calibrate`) gains the
    bench's sizes above one, measured once; without them the adaptive budget cannot price a
    batch's steps from what they cost."""
    from jetflow.bench import methods

    measured: list[list[int]] = []

    def with_batches(calibration: cal.Calibration, config, target, batch_sizes, **_) -> cal.Calibration:
        measured.append(list(batch_sizes))
        added = [cal.BatchPoint(rows=r, budgets=[0], draft_ms=[0.0], verify_ms=[1.0]) for r in batch_sizes]
        return calibration.model_copy(update={"batches": [*calibration.batches, *added]})

    monkeypatch.setattr(methods, "with_batches", with_batches)
    fields = {"drafters": ["ngram"], "budgets": ["auto"], "baselines": [], "batch_sizes": [1, 4, 2]}
    config = load_bench_config(None, fields)
    key = cal.key_for(_auto_config(config, "ngram"), bench_target)
    cal.save_calibration(_record(key, budget=3))

    assert methods.calibrate_auto_runs(config, bench_target) == [key]
    assert measured == [[2, 4]]
    assert [batch.rows for batch in cal.load_calibration(key).batches] == [2, 4]
    assert methods.calibrate_auto_runs(config, bench_target) == [], "measured once, then cached"
    assert measured == [[2, 4]]
    wider = load_bench_config(None, fields | {"batch_sizes": [2, 8]})
    methods.calibrate_auto_runs(wider, bench_target)
    assert measured == [[2, 4], [8]], "only the sizes it lacks"
