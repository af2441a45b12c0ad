"""``auto`` among the bench budgets: the calibrated budget, run under its own method name."""

from __future__ import annotations

import pytest
from jetflow.bench.config import load_bench_config
from jetflow.bench.methods import build_methods
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
