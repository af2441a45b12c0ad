"""The comparison runner on a tiny target: schema, reports, plots, multi-turn prompts, lossless flags."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from jetflow.bench.config import load_bench_config
from jetflow.bench.generation import Generation, Method
from jetflow.bench.methods import build_methods
from jetflow.bench.report import REPORT_MD, RESULTS_JSON, render_markdown, write_outputs
from jetflow.bench.results import RUN_KEYS, BenchResults
from jetflow.bench.runner import BenchmarkRunner, load_samples, run_benchmark, turn_prompt_ids
from jetflow.core.errors import ConfigError
from jetflow.core.target import Target

MAX_NEW = 12


def _config(prompt_file: Path, **overrides):
    fields = {
        "datasets": [f"file:{prompt_file}"],
        "budgets": [2, 6],
        "drafters": ["ngram", "ngram:chain"],
        "max_new_tokens": MAX_NEW,
        "warmup_tokens": 2,
    }
    return load_bench_config(None, {**fields, **overrides})


@pytest.fixture(scope="module")
def results(bench_target: Target, prompt_file: Path) -> BenchResults:
    return run_benchmark(_config(prompt_file), target=bench_target)


class Corrupted(Method):
    """A method that returns ``inner``'s tokens with one token changed: a lossless bug."""

    def __init__(self, inner: Method, position: int = 3) -> None:
        self.inner, self.position = inner, position
        self.name, self.budget, self.policy = "corrupted", None, None

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Generation:
        generation = self.inner.generate(prompt_ids, max_new_tokens)
        tokens = list(generation.token_ids)
        if len(tokens) > self.position:  # warm-ups are shorter
            tokens[self.position] += 1
        return replace(generation, token_ids=tuple(tokens))


def test_every_run_has_the_issue_schema(results: BenchResults) -> None:
    data = json.loads(json.dumps(results.to_dict()))
    assert set(data) == {"machine", "target", "settings", "runs"}
    assert isinstance(data["target"], str) and data["machine"]["cpu_count"]
    for run in data["runs"]:
        assert list(run)[: len(RUN_KEYS)] == list(RUN_KEYS)
        for key, types in RUN_KEYS.items():
            assert isinstance(run[key], types), (key, run[key])
            assert not (isinstance(run[key], bool) and bool not in types), key


def test_one_run_per_method_and_budget(results: BenchResults) -> None:
    methods = [(run["method"], run["budget"]) for run in results.runs]
    assert methods == [
        ("ar", None),
        ("hf-generate", None),
        ("hf-prompt-lookup", None),
        ("ngram", 2),
        ("ngram", 6),
        ("ngram:chain", 2),
        ("ngram:chain", 6),
    ]
    policies = {run["method"]: run["policy"] for run in results.runs}
    assert policies["ngram"] == "best-first" and policies["ngram:chain"] == "chain"


def test_runs_are_lossless_and_consistent(results: BenchResults) -> None:
    assert results.lossless and results.failures() == []
    for run in results.runs:
        assert run["dtype"] == "float32"
        assert run["n_prompts"] == 2 and run["n_turns"] == 3  # the chat sample has two user turns
        assert run["new_tokens"] == results.runs[0]["new_tokens"]  # same tokens as ar
        assert run["tau"] >= 1.0 and run["tokens_per_s"] > 0
        assert 0.0 <= run["draft_share"] <= 1.0
        if run["accept_histogram"] is not None:
            assert sum(run["accept_histogram"].values()) == run["steps"]
    ar = results.runs[0]
    assert ar["speedup_vs_ar"] == 1.0 and ar["tau"] == 1.0 and ar["accept_histogram"] == {"0": ar["steps"]}


def test_decode_speed_leaves_the_timed_prefill_out(results: BenchResults) -> None:
    engine = [run for run in results.runs if not run["method"].startswith("hf-")]
    for run in engine:
        assert 0.0 < run["prefill_share"] < 1.0
        assert run["decode_tokens_per_s"] > run["tokens_per_s"]
        decode_wall = run["wall_s"] * (1 - run["prefill_share"])
        assert run["decode_tokens_per_s"] == pytest.approx(run["new_tokens"] / decode_wall)
    assert engine[0]["decode_speedup_vs_ar"] == 1.0
    for run in results.runs:  # transformers.generate does not time its prefill apart
        if run["method"].startswith("hf-"):
            assert run["prefill_share"] is None and run["decode_speedup_vs_ar"] is None


def test_drafters_accept_tokens_on_a_repetitive_prompt(results: BenchResults) -> None:
    drafted = [run for run in results.runs if run["budget"] is not None]
    assert all(run["tau"] > 1.0 for run in drafted)
    assert any(int(k) > 0 for run in drafted for k in run["accept_histogram"])


def test_second_turn_follows_the_baselines_first_answer(bench_target: Target, prompt_file: Path) -> None:
    config = _config(prompt_file, drafters=[], baselines=[])
    runner = BenchmarkRunner(config, bench_target)
    chat = [s for s in load_samples(config)[f"file:{prompt_file}"] if s.id == "chat"]
    records = runner.run_dataset(chat)[0]
    first_answer = bench_target.decode(list(records[0].generation.token_ids))
    expected = bench_target.encode_prompt(
        [
            {"role": "user", "content": chat[0].turns[0]},
            {"role": "assistant", "content": first_answer},
            {"role": "user", "content": chat[0].turns[1]},
        ]
    )
    assert [r.turn for r in records] == [0, 1]
    assert list(records[1].prompt_ids) == expected
    assert turn_prompt_ids(bench_target, chat[0], 1, [first_answer]) == tuple(expected)


def test_a_corrupted_method_is_a_real_divergence(bench_target: Target, prompt_file: Path) -> None:
    config = _config(prompt_file, drafters=[], baselines=[])
    ar = build_methods(config, bench_target)[0]
    runner = BenchmarkRunner(config, bench_target, methods=[ar, Corrupted(ar)])
    results = runner.run(load_samples(config))
    corrupted = results.runs[1]
    assert results.runs[0]["lossless"] and not corrupted["lossless"] and not results.lossless
    assert [d["position"] for d in corrupted["divergences"]] == [3, 3, 3]
    assert {d["kind"] for d in corrupted["divergences"]} == {"bug"}
    assert len(results.failures()) == 3 and "corrupted" in results.failures()[0]


def test_the_reference_must_come_first(bench_target: Target, prompt_file: Path) -> None:
    config = _config(prompt_file, drafters=[], baselines=[])
    ar = build_methods(config, bench_target)[0]
    with pytest.raises(ValueError, match="first method must be 'ar'"):
        BenchmarkRunner(config, bench_target, methods=[Corrupted(ar)])


def test_outputs_are_written_and_readable(results: BenchResults, tmp_path: Path) -> None:
    paths = write_outputs(results, tmp_path / "out")
    names = sorted(path.name for path in paths)
    assert names == sorted([RESULTS_JSON, REPORT_MD, "tau_vs_budget.png", "speedup.png"])
    for path in paths:
        assert path.stat().st_size > 0
    png = (tmp_path / "out" / "speedup.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert BenchResults.read_json(tmp_path / "out" / RESULTS_JSON).to_dict() == json.loads(
        json.dumps(results.to_dict())
    )
    report = (tmp_path / "out" / REPORT_MD).read_text()
    assert "Lossless check passed" in report
    assert "| `ngram:chain` | 6 |" in report and "![speedup](speedup.png)" in report


def test_report_flags_a_failed_lossless_check(results: BenchResults, tmp_path: Path) -> None:
    broken = json.loads(json.dumps(results.to_dict()))
    bug = {"sample_id": "loop", "turn": 0, "position": 5, "expected": 7, "got": 8, "logit_gap": 3.0}
    broken["runs"][3].update(lossless=False, divergences=[{**bug, "kind": "bug"}])
    paths = write_outputs(BenchResults(**broken), tmp_path)
    report = paths[1].read_text()
    assert "Lossless check FAILED: 1 real divergence" in report and "**NO**" in report


def test_baselines_only_still_reports(bench_target: Target, prompt_file: Path, tmp_path: Path) -> None:
    config = _config(prompt_file, drafters=[], baselines=["hf-generate"], warmup_tokens=0)
    results = run_benchmark(config, target=bench_target)
    assert [run["method"] for run in results.runs] == ["ar", "hf-generate"]
    names = {path.name for path in write_outputs(results, tmp_path)}
    assert "tau_vs_budget.png" not in names and "speedup.png" in names


def test_sampled_runs_use_the_sampling_verifier_and_are_not_compared(
    bench_target: Target, prompt_file: Path
) -> None:
    config = _config(prompt_file, temperature=1.0, seed=3, budgets=[6], drafters=["ngram"], baselines=[])
    methods = build_methods(config, bench_target)
    assert [method.engine.verifier.name for method in methods] == ["sampling", "sampling"]
    first = run_benchmark(config, target=bench_target)
    again = run_benchmark(config, target=bench_target)
    greedy = run_benchmark(config.model_copy(update={"temperature": 0.0}), target=bench_target)
    assert [run["lossless"] for run in first.runs] == [None, None] and first.lossless
    assert all(run["temperature"] == 1.0 for run in first.runs)
    # seeded: the same samples again; sampled: not the greedy run (a random tiny model at T=1)
    assert [(run["new_tokens"], run["steps"]) for run in first.runs] == [
        (run["new_tokens"], run["steps"]) for run in again.runs
    ]
    assert [(run["new_tokens"], run["steps"]) for run in first.runs] != [
        (run["new_tokens"], run["steps"]) for run in greedy.runs
    ]
    assert [run["lossless"] for run in greedy.runs] == [True, True]
    assert "Sampling at temperature 1.0" in render_markdown(first)


def test_a_resumed_run_keeps_measured_data_sets_and_runs_the_rest(
    bench_target: Target, prompt_file: Path, tmp_path: Path
) -> None:
    second = tmp_path / "second.jsonl"
    second.write_text(json.dumps({"id": "more", "prompt": "w7 w8 w9 w7 w8 w9"}) + "\n")
    fields = {"budgets": [6], "drafters": ["ngram"], "baselines": []}
    saved: list[int] = []
    first = run_benchmark(_config(prompt_file, **fields), target=bench_target)
    both = _config(prompt_file, **fields, datasets=[f"file:{prompt_file}", f"file:{second}"])
    resumed = run_benchmark(
        both, target=bench_target, previous=first, on_dataset=lambda r: saved.append(len(r.runs))
    )
    assert resumed.runs[:2] == first.runs  # kept, not measured again
    assert [run["dataset"] for run in resumed.runs[2:]] == [f"file:{second}"] * 2
    assert saved == [4]  # saved after the one data set that ran
    path = tmp_path / "results.json"
    first.write_json(path)
    assert BenchResults.read_json(path).runs == first.runs
    with pytest.raises(ConfigError, match="max_new_tokens"):
        run_benchmark(
            both.model_copy(update={"max_new_tokens": MAX_NEW + 1}), target=bench_target, previous=first
        )
    path.write_text(path.read_text()[:100])
    with pytest.raises(ConfigError, match="not a complete jetflow results file"):
        BenchResults.read_json(path)
