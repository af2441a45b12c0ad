"""Which settings may differ between the processes that fill one results file."""

from __future__ import annotations

from pathlib import Path

import pytest
from jetflow.bench.report import data_line
from jetflow.bench.results import BenchResults, check_compatible, merge_saved
from jetflow.core.errors import ConfigError


def _results(dataset: str, auto_budget: int, fixed_budget: int = 4) -> BenchResults:
    methods = [
        {"method": "ar", "budget": None, "policy": None},
        {"method": "ngram", "budget": fixed_budget, "policy": "best-first"},
        {"method": "ngram@auto", "budget": auto_budget, "policy": "best-first"},
    ]
    settings = {"max_new_tokens": 8, "methods": methods, "datasets": [dataset], "n_samples": {dataset: 2}}
    runs = [{"method": m["method"], "dataset": dataset, "budget": m["budget"]} for m in methods]
    return BenchResults({"cpu": "test"}, "tiny", settings, runs)


def test_data_sets_whose_auto_runs_started_from_other_budgets_share_one_file(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    merge_saved(path, _results("a", auto_budget=4))
    merged = merge_saved(path, _results("b", auto_budget=2))
    assert [(run["dataset"], run["budget"]) for run in merged.runs if run["method"] == "ngram@auto"] == [
        ("a", 4),
        ("b", 2),
    ]


def test_one_data_set_never_mixes_auto_runs_from_two_budgets() -> None:
    with pytest.raises(ConfigError, match="methods"):
        check_compatible(_results("a", auto_budget=4), _results("a", auto_budget=2))


def test_a_fixed_budget_that_differs_is_still_refused(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    merge_saved(path, _results("a", auto_budget=4))
    with pytest.raises(ConfigError, match=r"cannot resume.*methods"):
        merge_saved(path, _results("b", auto_budget=4, fixed_budget=8))


def _with_variants(results: BenchResults, drafters: list[str], variants: dict[str, str]) -> BenchResults:
    defined = {name: {"drafter": "jetflow", "params": {"checkpoint": at}} for name, at in variants.items()}
    results.settings |= {"drafters": drafters, "variants": defined}
    return results


def test_a_variant_defined_but_not_measured_does_not_stop_a_resume() -> None:
    saved = _with_variants(_results("a", 4), ["arm:best-first"], {"arm": "heads/arm"})
    current = _with_variants(_results("a", 4), ["arm:best-first"], {"arm": "heads/arm", "new": "heads/new"})
    check_compatible(saved, current)
    check_compatible(current, saved)


def test_a_measured_variant_whose_parameters_changed_is_refused() -> None:
    saved = _with_variants(_results("a", 4), ["arm"], {"arm": "heads/arm"})
    current = _with_variants(_results("a", 4), ["arm"], {"arm": "heads/retrained"})
    with pytest.raises(ConfigError, match=r"cannot resume.*variants"):
        check_compatible(saved, current)


def test_a_resume_that_measures_nothing_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    merge_saved(path, _results("a", auto_budget=4))
    before = path.read_text()
    again = _results("a", auto_budget=4)
    again.settings["command"] = "jetflow bench --resume"
    merge_saved(path, again)
    assert path.read_text() == before


def test_the_report_names_the_data_sets_loaded_but_not_yet_measured() -> None:
    results = _results("champ", 4)
    results.settings["n_samples"] |= {"mtbench": 2}
    assert data_line(results) == "champ (2 samples); not yet measured: mtbench"
    results.runs.append({"method": "ar", "dataset": "mtbench", "budget": None})
    assert data_line(results) == "champ (2 samples), mtbench (2 samples)"
