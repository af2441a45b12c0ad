"""The batch axis (``jetflow bench --batch-sizes``) on a tiny target: rows per batch size x method,
throughput and speedups from the calls' timings, per-sequence lossless checks against batched and
solo ``ar``, the report and plots, config errors, and the per-prompt comparison left as it was."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from jetflow.bench.batched import BatchBenchmarkRunner, BatchRun, summarise_batch
from jetflow.bench.config import BenchConfig, load_bench_config
from jetflow.bench.generation import BatchGeneration, BatchMethod, Generation, batchable
from jetflow.bench.hf_baselines import HFGenerateMethod
from jetflow.bench.methods import EngineMethod, build_methods
from jetflow.bench.metrics import TurnRecord
from jetflow.bench.plots import (
    BATCH_BUDGET_PLOT,
    BATCH_SPEEDUP_PLOT,
    batch_budget_figure,
    batch_speedup_figure,
    write_plots,
)
from jetflow.bench.report import REPORT_MD, RESULTS_JSON, render_markdown, write_outputs
from jetflow.bench.results import RUN_KEYS, BenchResults, refuse_other_results
from jetflow.bench.runner import load_samples, run_benchmark
from jetflow.bench.suite import bench_cases
from jetflow.cli.bench import command_line
from jetflow.cli.main import main
from jetflow.core.errors import ConfigError
from jetflow.core.result import GenerationResult, StepRecord
from jetflow.core.target import Target

from tests.bench.conftest import chat_target, words

MAX_NEW = 10
SIZES = [1, 2, 4]
ASKED = [2, 4, 1]  # any order: they run, and are reported, ascending
#: the keys of a batched run after the common ones (results.json's contract for the batch axis)
BATCH_KEYS = (
    "batch_size",
    "speedup_vs_hf_generate",
    "mean_latency_s",
    "max_latency_s",
    "mean_batch_budget",
    "mean_rows",
)


def _config(prompt_file: Path, **overrides) -> BenchConfig:
    fields = {
        "datasets": [f"file:{prompt_file}"],
        "budgets": [4],
        "drafters": ["ngram"],
        "max_new_tokens": MAX_NEW,
        "warmup_tokens": 2,
        "batch_sizes": ASKED,
    }
    return load_bench_config(None, {**fields, **overrides})


@pytest.fixture(scope="module")
def batched(bench_target: Target, prompt_file: Path) -> BenchResults:
    return run_benchmark(_config(prompt_file), target=bench_target)


# ---------------------------------------------------------------- the runs
def test_one_row_per_batch_size_and_method_with_the_schema(batched: BenchResults) -> None:
    rows = [(run["batch_size"], run["method"], run["budget"]) for run in batched.runs]
    assert rows == [
        (b, m, budget) for b in SIZES for m, budget in [("ar", None), ("hf-generate", None), ("ngram", 4)]
    ]
    data = json.loads(json.dumps(batched.to_dict()))
    for run in data["runs"]:
        assert list(run)[: len(RUN_KEYS)] == list(RUN_KEYS)
        assert list(run)[len(RUN_KEYS) : len(RUN_KEYS) + len(BATCH_KEYS)] == list(BATCH_KEYS)
        for key, types in RUN_KEYS.items():
            assert isinstance(run[key], types), (key, run[key])
    assert batched.settings["batch_sizes"] == ASKED
    # transformers' prompt lookup cannot batch: left out, and said so
    assert "hf-prompt-lookup" in batched.settings["left_out"]
    assert [m["method"] for m in batched.settings["methods"]] == ["ar", "hf-generate", "ngram"]


def test_every_row_is_lossless_and_decodes_every_turn(batched: BenchResults) -> None:
    assert batched.lossless and batched.failures() == []
    solo_tokens = batched.runs[0]["new_tokens"]
    for run in batched.runs:
        assert run["lossless"] is True and run["divergences"] == []
        assert run["n_prompts"] == 2 and run["n_turns"] == 3  # the chat sample's two turns too
        assert run["new_tokens"] == solo_tokens  # the same tokens at every batch size
        assert run["tokens_per_s"] > 0 and run["mean_latency_s"] > 0
        assert run["max_latency_s"] >= run["mean_latency_s"]
        assert 1.0 <= run["mean_rows"] <= run["batch_size"]
    for run in batched.runs:
        if run["method"] == "ar":
            assert run["speedup_vs_ar"] == 1.0 and run["tau"] == 1.0 and run["mean_batch_budget"] is None
        if run["method"] == "hf-generate":
            assert run["speedup_vs_hf_generate"] == 1.0 and run["tau"] == 1.0
        if run["method"] == "ngram":  # a repetitive prompt: the drafter accepts
            assert run["tau"] > 1.0 and run["mean_batch_budget"] > 0


def test_the_batch_size_bounds_the_rows_in_flight(batched: BenchResults) -> None:
    """Two prompts in the first wave, one in the second: a batch of 1 runs one row at a time,
    any larger batch both first-turn prompts at once."""
    by = {(run["batch_size"], run["method"]): run for run in batched.runs}
    assert by[1, "ar"]["mean_rows"] == 1.0 and by[1, "ar"]["forwards"] == by[1, "ar"]["steps"]
    for size in (2, 4):
        ar = by[size, "ar"]
        assert ar["forwards"] < ar["steps"]  # forwards shared by two rows
        assert ar["mean_rows"] == pytest.approx(ar["steps"] / ar["forwards"])
        assert by[size, "ngram"]["mean_batch_budget"] <= 4 * 2


# ---------------------------------------------------------------- the arithmetic
def _row(tokens: int, wall_s: float, steps: int, budgets: tuple[int, ...] | None = None) -> Generation:
    return Generation(tuple(range(tokens)), wall_s, steps, 0.0, 0.0, (0,) * steps, budgets, 0.1)


class _Named:
    def __init__(self, name: str, budget: int | None = None) -> None:
        self.name, self.budget, self.policy = name, budget, None


def _run(name: str, calls: Sequence[BatchGeneration], size: int = 4, budget: int | None = None) -> BatchRun:
    run = BatchRun(_Named(name, budget), size)
    for call in calls:
        run.calls.append(call)
        run.records += [TurnRecord(f"s{i}", 0, (1,), row) for i, row in enumerate(call.rows)]
    return run


def test_throughput_speedups_latency_and_budget_come_from_the_calls() -> None:
    """Throughput is every row's tokens over the calls' wall time, not over the rows' latencies
    (which overlap); tau is per sequence; the batch budget is a mean over forwards."""
    ar = _run("ar", [BatchGeneration((_row(10, 1.5, 10), _row(30, 2.0, 30)), 2.0, 30, 40, 0.0, 1.8)])
    hf = _run("hf-generate", [BatchGeneration((_row(10, 1.0, 10), _row(30, 1.0, 30)), 1.0, 30, 40, 0.0, 0.9)])
    drafted = _run(
        "ngram",
        [
            BatchGeneration((_row(10, 0.25, 4), _row(20, 0.5, 8)), 0.5, 8, 12, 0.1, 0.3, {"4": 6, "8": 2}),
            BatchGeneration((_row(10, 0.5, 5),), 0.5, 5, 5, 0.05, 0.4, {"0": 1, "2": 4}),
        ],
        budget=4,
    )
    row = summarise_batch(drafted, "set", "float32", ar, hf)
    assert row["new_tokens"] == 40 and row["wall_s"] == 1.0
    assert row["tokens_per_s"] == 40.0  # 40 tokens in 1 s of calls
    assert row["speedup_vs_ar"] == pytest.approx(40.0 / 20.0)  # ar: 40 tokens in 2 s
    assert row["speedup_vs_hf_generate"] == pytest.approx(40.0 / 40.0)
    assert row["tau"] == pytest.approx(40 / 17)  # tokens over each row's forwards
    assert row["forwards"] == 13 and row["mean_rows"] == pytest.approx(17 / 13)
    assert row["mean_latency_s"] == pytest.approx((0.25 + 0.5 + 0.5) / 3) and row["max_latency_s"] == 0.5
    assert row["mean_batch_budget"] == pytest.approx((4 * 6 + 8 * 2 + 0 * 1 + 2 * 4) / 13)
    assert row["batch_budget_histogram"] == {"0": 1, "2": 4, "4": 6, "8": 2}
    assert row["draft_share"] == pytest.approx(0.15) and row["verify_share"] == pytest.approx(0.7)
    assert row["prefill_share"] == pytest.approx(0.3)
    assert summarise_batch(drafted, "set", "float32", ar)["speedup_vs_hf_generate"] is None
    assert summarise_batch(ar, "set", "float32", ar)["mean_batch_budget"] is None


def test_an_engine_call_counts_each_forward_once() -> None:
    """Every row records the forwards it was in: the call's figures count each forward once."""

    def step(rows: int, budget: int, total: int) -> StepRecord:
        return StepRecord(0, budget + 1, 0.2, 0.6, 1, budget, rows, total)

    def result(steps: list[StepRecord], wall_s: float) -> GenerationResult:
        return GenerationResult([1], [5] * len(steps), "", "length", wall_s, 4, steps, prefill_s=0.1)

    two, alone = [step(2, 3, 7)] * 3, [step(1, 4, 2)] * 2  # two rows draft 3 + 4 nodes, then one row
    results = [result(two, 1.0), result([step(2, 4, 7)] * 3 + alone, 2.0)]
    engine = SimpleNamespace(budget=4, policy=SimpleNamespace(name="best-first"), drafter=object())
    engine.generate_batch = lambda prompts, max_new_tokens, batch_size: results
    call = EngineMethod("ngram", engine).generate_batch([[1], [2]], 8, 2)
    assert (call.forwards, call.row_steps) == (5, 8)
    assert call.batch_budgets == {"2": 2, "7": 3}  # the nodes of all rows, per forward
    assert call.draft_s == pytest.approx(5 * 0.2) and call.verify_s == pytest.approx(5 * 0.6)
    assert [row.budgets for row in call.rows] == [(3, 3, 3), (4, 4, 4, 4, 4)]  # each row's own share
    assert [row.wall_s for row in call.rows] == [1.0, 2.0]  # each row's latency
    engine.budget = None  # ar: no tree
    assert EngineMethod("ar", engine).generate_batch([[1]], 8, 2).batch_budgets is None


def test_hf_generate_batches_left_padded_and_ends_each_row_at_its_eos() -> None:
    target = chat_target()
    prompts = [target.encode_prompt(words(*numbers)) for numbers in ([3, 4, 5, 6] * 4, [10, 11], [7, 8, 9])]
    free = [HFGenerateMethod("hf-generate", target).generate(p, MAX_NEW).token_ids for p in prompts]
    eos = free[0][3]  # a token the first answer emits now ends generation
    target.__dict__["eos_token_ids"] = frozenset({eos})
    method = HFGenerateMethod("hf-generate", target)
    alone = [method.generate(prompt, MAX_NEW).token_ids for prompt in prompts]
    assert alone[0] == free[0][: free[0].index(eos) + 1] and max(map(len, alone)) == MAX_NEW
    call = method.generate_batch(prompts, MAX_NEW, 2)
    assert [row.token_ids for row in call.rows] == alone  # padding and the finished row cut away
    assert call.forwards == max(map(len, alone[:2])) + len(alone[2])  # a batch runs until its last row
    assert call.row_steps == sum(map(len, alone)) and [row.steps for row in call.rows] == list(
        map(len, alone)
    )
    assert call.rows[0].wall_s == call.rows[1].wall_s != call.rows[2].wall_s
    lookup = HFGenerateMethod("hf-prompt-lookup", target, prompt_lookup_num_tokens=4)
    assert not batchable(lookup) and batchable(method)
    with pytest.raises(ValueError, match="one sequence at a time"):
        lookup.generate_batch(prompts, MAX_NEW, 2)


class Timed(BatchMethod):
    """``inner`` with every call's wall time replaced: throughput must follow it exactly."""

    batchable = True

    def __init__(self, inner: BatchMethod, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds
        self.name, self.budget, self.policy = inner.name, inner.budget, inner.policy

    def generate(self, prompt_ids, max_new_tokens):  # pragma: no cover - the batch axis only
        return self.inner.generate(prompt_ids, max_new_tokens)

    def generate_batch(self, prompts, max_new_tokens, batch_size):
        return replace(self.inner.generate_batch(prompts, max_new_tokens, batch_size), wall_s=self.seconds)


def test_the_runner_times_whole_calls(bench_target: Target, prompt_file: Path) -> None:
    config = _config(prompt_file, batch_sizes=[2], warmup_tokens=0)
    ar, hf, _, ngram = build_methods(config, bench_target)
    methods = [Timed(ar, 2.0), Timed(hf, 1.0), Timed(ngram, 0.5)]
    results = BatchBenchmarkRunner(config, bench_target, methods=methods).run(load_samples(config))
    ar_row, hf_row, ngram_row = results.runs
    waves = 2  # the chat sample's second turn is a second call
    assert ar_row["wall_s"] == 2.0 * waves and ngram_row["wall_s"] == 0.5 * waves
    assert ar_row["tokens_per_s"] == pytest.approx(ar_row["new_tokens"] / 4.0)
    assert ngram_row["speedup_vs_ar"] == pytest.approx(4.0)
    assert ngram_row["speedup_vs_hf_generate"] == pytest.approx(2.0)
    assert hf_row["speedup_vs_ar"] == pytest.approx(2.0)


# ---------------------------------------------------------------- lossless
class Corrupted(BatchMethod):
    """``inner``'s rows with one token changed, at the batch sizes in ``at`` (all by default)."""

    batchable = True

    def __init__(self, inner: BatchMethod, name: str | None = None, at: Sequence[int] | None = None) -> None:
        self.inner, self.at = inner, at
        self.name, self.budget, self.policy = name or inner.name, inner.budget, inner.policy

    def generate(self, prompt_ids, max_new_tokens):  # pragma: no cover - the batch axis only
        return self.inner.generate(prompt_ids, max_new_tokens)

    def generate_batch(self, prompts, max_new_tokens, batch_size):
        call = self.inner.generate_batch(prompts, max_new_tokens, batch_size)
        if self.at is not None and batch_size not in self.at:
            return call
        rows = []
        for row in call.rows:
            tokens = list(row.token_ids)
            if len(tokens) > 3:  # warm-ups are shorter
                tokens[3] += 1
            rows.append(replace(row, token_ids=tuple(tokens)))
        return replace(call, rows=tuple(rows))


def test_a_corrupted_method_fails_against_batched_and_solo_ar(
    bench_target: Target, prompt_file: Path
) -> None:
    config = _config(prompt_file, batch_sizes=[1, 2], baselines=[], warmup_tokens=0)
    ar, ngram = build_methods(config, bench_target)
    runner = BatchBenchmarkRunner(config, bench_target, methods=[ar, Corrupted(ngram, "corrupted")])
    results = runner.run(load_samples(config))
    assert not results.lossless
    by = {(run["batch_size"], run["method"]): run for run in results.runs}
    assert by[1, "ar"]["lossless"] and by[2, "ar"]["lossless"]
    at_1, at_2 = by[1, "corrupted"], by[2, "corrupted"]
    assert not at_1["lossless"] and not at_2["lossless"]
    assert {d["kind"] for d in at_1["divergences"] + at_2["divergences"]} == {"bug"}
    assert [d["against"] for d in at_1["divergences"]] == ["ar at batch 1"] * 3
    # at batch 2 each of the 3 sequences leaves batched ar and ar alone
    assert sorted(d["against"] for d in at_2["divergences"]) == ["ar at batch 1"] * 3 + ["ar at batch 2"] * 3
    assert all(d["position"] == 3 for d in at_2["divergences"])
    failures = results.failures()
    assert len(failures) == 9 and any("corrupted budget 4 batch 2 on file:" in line for line in failures)
    assert any("baseline (ar at batch 1) has" in line for line in failures)


def test_batched_ar_is_checked_against_ar_alone(bench_target: Target, prompt_file: Path) -> None:
    """ar that goes wrong only when batched: its own rows fail against ar at batch size 1 (measured
    in an extra pass where 1 is not among the batch sizes), and a correct drafter then fails against
    batched ar while it still equals ar alone."""
    config = _config(prompt_file, batch_sizes=[2], baselines=[], warmup_tokens=0)
    ar, ngram = build_methods(config, bench_target)
    runner = BatchBenchmarkRunner(config, bench_target, methods=[Corrupted(ar, at=[2]), ngram])
    ar_row, ngram_row = runner.run(load_samples(config)).runs
    assert [run["batch_size"] for run in (ar_row, ngram_row)] == [2, 2]  # the solo pass is no row
    assert not ar_row["lossless"] and {d["against"] for d in ar_row["divergences"]} == {"ar at batch 1"}
    assert len(ar_row["divergences"]) == 3
    assert not ngram_row["lossless"] and {d["against"] for d in ngram_row["divergences"]} == {"ar at batch 2"}


def test_divergences_within_the_tolerance_are_rounding_ties(bench_target: Target, prompt_file: Path) -> None:
    config = _config(prompt_file, batch_sizes=[2], baselines=[], warmup_tokens=0)
    ar, ngram = build_methods(config, bench_target)
    runner = BatchBenchmarkRunner(config, bench_target, methods=[ar, Corrupted(ngram)])
    runner.checker.exact, runner.checker.tie_tolerance = False, math.inf  # as on packed weights
    (_, row) = runner.run(load_samples(config)).runs
    assert row["lossless"] is True and row["rounding_ties"] == 6
    assert {d["kind"] for d in row["divergences"]} == {"tie"}
    assert "yes (6 rounding ties)" in render_markdown(BenchResults({}, "t", {"batch_sizes": [2]}, [row]))


def test_sampled_batches_are_not_compared(bench_target: Target, prompt_file: Path) -> None:
    config = _config(prompt_file, batch_sizes=[2], baselines=[], temperature=1.0, warmup_tokens=0)
    ar, ngram = build_methods(config, bench_target)
    results = BatchBenchmarkRunner(config, bench_target, methods=[ar, Corrupted(ngram)]).run(
        load_samples(config)
    )
    assert [run["lossless"] for run in results.runs] == [None, None] and results.lossless


# ---------------------------------------------------------------- report and plots
def test_report_and_plots_show_the_batch_axis(batched: BenchResults, tmp_path: Path) -> None:
    paths = write_outputs(batched, tmp_path)
    assert [path.name for path in paths] == [RESULTS_JSON, REPORT_MD, BATCH_SPEEDUP_PLOT, BATCH_BUDGET_PLOT]
    assert all(path.read_bytes().startswith(b"\x89PNG") for path in paths[2:])
    report = (tmp_path / REPORT_MD).read_text()
    assert "Batch axis (batch sizes 1, 2, 4)" in report and "Not batched: `hf-prompt-lookup`" in report
    assert "| dataset | method | batch 1 | batch 2 | batch 4 |" in report
    header = (
        "| batch | method | budget | tau | tokens/s | speedup | vs hf-generate | mean rows | "
        "mean latency (s) | batch budget / forward | lossless |"
    )
    assert header in report
    ngram = next(r for r in batched.runs if r["method"] == "ngram" and r["batch_size"] == 4)
    assert f"| 4 | `ngram` | 4 | {ngram['tau']:.2f} | {ngram['tokens_per_s']:.1f} |" in report
    assert "## Best speedup per method" not in report and "decode speedup" not in report
    assert "![speedup_vs_batch](speedup_vs_batch.png)" in report


def test_report_lists_divergences_with_their_reference(batched: BenchResults) -> None:
    broken = json.loads(json.dumps(batched.to_dict()))
    bug = {"sample_id": "loop", "turn": 0, "position": 5, "expected": 7, "got": 8, "logit_gap": 3.0}
    broken["runs"][-1].update(
        lossless=False, divergences=[{**bug, "kind": "bug", "against": "ar at batch 1"}]
    )
    report = render_markdown(BenchResults(**broken))
    assert "Lossless check FAILED: 1 real divergence" in report and "**NO**" in report
    assert (
        "| 4 | `ngram` | file:" in report
        and "| ar at batch 1 | loop | 0 | 5 | 7 | 8 | 3.0000 | bug |" in report
    )


def test_plots_draw_speedup_and_budget_against_batch_size(batched: BenchResults) -> None:
    (ax,) = batch_speedup_figure(batched.runs).axes
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert set(lines) == {"hf-generate", "ngram@4"}  # ar is the dashed 1.0 line
    for label, method in (("hf-generate", "hf-generate"), ("ngram@4", "ngram")):
        expected = [r["speedup_vs_ar"] for r in batched.runs if r["method"] == method]
        assert list(lines[label].get_xdata()) == SIZES
        assert np.allclose(lines[label].get_ydata(), expected)
    (budget_ax,) = batch_budget_figure(batched.runs).axes
    (line,) = budget_ax.get_lines()  # the drafter alone has a budget
    expected = [r["mean_batch_budget"] for r in batched.runs if r["method"] == "ngram"]
    assert np.allclose(line.get_ydata(), expected) and budget_ax.get_xscale() == "log"
    only_ar = [r for r in batched.runs if r["method"] == "ar"]
    assert batch_budget_figure(only_ar) is None and batch_speedup_figure(only_ar) is None


def test_no_drafter_writes_the_speedup_plot_alone(
    bench_target: Target, prompt_file: Path, tmp_path: Path
) -> None:
    config = _config(prompt_file, drafters=[], batch_sizes=[1, 2], warmup_tokens=0)
    results = run_benchmark(config, target=bench_target)
    assert [(r["batch_size"], r["method"]) for r in results.runs] == [
        (1, "ar"),
        (1, "hf-generate"),
        (2, "ar"),
        (2, "hf-generate"),
    ]
    assert [path.name for path in write_plots(results.runs, tmp_path)] == [BATCH_SPEEDUP_PLOT]


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([0], "invalid config: batch_sizes: a batch size is an integer >= 1, got 0"),
        ([1, -4], "a batch size is an integer >= 1, got -4"),
        (["x"], "a batch size is an integer >= 1, got 'x'"),
        ([1.5], "a batch size is an integer >= 1, got 1.5"),
        ([True], "a batch size is an integer >= 1, got True"),
        ([], "give a list of batch sizes"),
        (4, "give a list of batch sizes (integers >= 1, e.g. [1, 4, 16]), got 4"),
        ([2, 4, 2], "batch size 2 is listed twice in [2, 4, 2]"),
    ],
)
def test_bad_batch_sizes_are_config_errors(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_bench_config(None, {"batch_sizes": value})
    assert message in str(caught.value)


def test_batch_sizes_from_toml_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "bench.toml"
    path.write_text('drafters = ["ngram"]\nbatch_sizes = [1, 8, 32]\n')
    assert load_bench_config(path).batch_sizes == (1, 8, 32)
    assert load_bench_config(path, {"batch_sizes": ["2", " 4"]}).batch_sizes == (2, 4)  # the CLI's text
    path.write_text("batch_sizes = [1, 0]\n")
    with pytest.raises(ConfigError, match="batch_sizes: a batch size is an integer >= 1, got 0"):
        load_bench_config(path)
    assert load_bench_config(None).batch_sizes is None
    with pytest.raises(ConfigError, match="batch_sizes: vLLM's methods are not run with a batch axis"):
        load_bench_config(None, {"batch_sizes": [2], "vllm": True})


@pytest.mark.parametrize(("flag", "message"), [("0", "got 0"), ("1,x", "got 'x'"), ("2,2", "listed twice")])
def test_bad_batch_size_flags_fail_before_loading(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    flag: str,
    message: str,
) -> None:
    monkeypatch.setattr(Target, "load", lambda *a, **k: pytest.fail("the target must not load"))
    monkeypatch.chdir(tmp_path)
    code = main(["bench", "--no-progress", "--batch-sizes", flag])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("jetflow: error: invalid config: batch_sizes: ") and message in err


# ---------------------------------------------------------------- the per-prompt comparison unchanged
#: what results.json held before the batch axis (the keys of experiments/fp32-every-cpu/packed)
PER_PROMPT_SETTINGS = [
    "target", "dtype", "drafters", "datasets", "limit", "budgets", "max_new_tokens", "baselines",
    "prompt_lookup_tokens", "warmup_tokens", "tie_tolerance", "tree", "drafter_params", "variants",
    "threads", "temperature", "seed", "compile", "out", "resolved_dtype", "methods", "n_samples",
]  # fmt: skip
PER_PROMPT_RUN = [
    "method", "dataset", "budget", "n_prompts", "new_tokens", "tau", "tokens_per_s", "speedup_vs_ar",
    "draft_share", "lossless", "dtype", "policy", "n_turns", "steps", "wall_s", "verify_share",
    "prefill_share", "decode_tokens_per_s", "decode_speedup_vs_ar", "accept_histogram", "budget_histogram",
    "rounding_ties", "divergences", "reference", "speedup_vs_reference", "temperature",
]  # fmt: skip
PACKED = Path(__file__).resolve().parents[2] / "experiments" / "fp32-every-cpu" / "packed"


def test_without_batch_sizes_the_results_keep_their_keys(bench_target: Target, prompt_file: Path) -> None:
    config = _config(prompt_file, batch_sizes=None, baselines=[], warmup_tokens=0)
    results = run_benchmark(config, target=bench_target)
    assert list(results.settings) == PER_PROMPT_SETTINGS
    assert [list(run) for run in results.runs] == [PER_PROMPT_RUN, PER_PROMPT_RUN]
    assert "--batch-sizes" not in command_line(config, None)
    assert "--batch-sizes 2,4,1" in command_line(_config(prompt_file), None)
    assert [case.batch_size for case in bench_cases(config)] == [None, None]


def test_suite_cases_gain_the_batch_axis(prompt_file: Path) -> None:
    config = load_bench_config(None, {"datasets": ["champ"], "budgets": [8], "batch_sizes": [4, 1]})
    assert [case.id for case in bench_cases(config)] == [
        "champ-ar-batch1",
        "champ-hf-generate-batch1",  # prompt lookup does not batch
        "champ-ngram-B8-batch1",
        "champ-ar-batch4",
        "champ-hf-generate-batch4",
        "champ-ngram-B8-batch4",
    ]


def test_a_saved_per_prompt_report_renders_as_it_was_written() -> None:
    """The committed report of a per-prompt comparison is rebuilt byte for byte from its results."""
    results = BenchResults.read_json(PACKED / RESULTS_JSON)
    plots = [PACKED / "tau_vs_budget.png", PACKED / "speedup.png"]
    assert render_markdown(results, plots) == (PACKED / REPORT_MD).read_text()


def test_a_folder_of_one_kind_refuses_a_run_of_the_other(batched: BenchResults, tmp_path: Path) -> None:
    path = batched.write_json(tmp_path / RESULTS_JSON)
    unbatched = batched.settings | {"batch_sizes": None}
    with pytest.raises(ConfigError, match=r"batch_sizes \(\[2, 4, 1\] -> None\)"):
        refuse_other_results(path, unbatched)
    with pytest.raises(ConfigError, match=r"batch_sizes \(\[2, 4, 1\] -> \[1, 2\]\)"):
        refuse_other_results(path, batched.settings | {"batch_sizes": [1, 2]})
    refuse_other_results(path, batched.settings)  # the same comparison again: allowed
    saved = {key: value for key, value in batched.settings.items() if key != "batch_sizes"}
    BenchResults(batched.machine, batched.target, saved).write_json(path)
    with pytest.raises(ConfigError, match=r"batch_sizes \(None -> \[2, 4, 1\]\)"):
        refuse_other_results(path, batched.settings)


# ---------------------------------------------------------------- the command
def _argv(tiny_target_dir: Path, prompt_file: Path, out: Path, *more: str) -> list[str]:
    return [
        "bench", "--target", str(tiny_target_dir), "--dtype", "float32", "--datasets", f"file:{prompt_file}",
        "--drafters", "ngram", "--budgets", "4", "--max-new-tokens", "8", "--out", str(out), "--no-progress",
        *more,
    ]  # fmt: skip


def test_the_command_writes_the_batch_axis_and_resumes(
    capsys: pytest.CaptureFixture[str], tiny_target_dir: Path, prompt_file: Path, tmp_path: Path
) -> None:
    argv = _argv(tiny_target_dir, prompt_file, tmp_path, "--batch-sizes", "1,2")
    assert main(argv) == 0
    out, _ = capsys.readouterr()
    names = {path.name for path in tmp_path.iterdir()}
    assert {RESULTS_JSON, REPORT_MD, BATCH_SPEEDUP_PLOT, BATCH_BUDGET_PLOT} <= names
    assert "tau_vs_budget.png" not in names and "speedup.png" not in names
    results = json.loads((tmp_path / RESULTS_JSON).read_text())
    assert [(r["batch_size"], r["method"]) for r in results["runs"]] == [
        (b, m) for b in (1, 2) for m in ("ar", "hf-generate", "ngram")
    ]
    assert "--batch-sizes 1,2" in results["settings"]["command"]
    assert "ngram B=4 batch 2" in out
    first = (tmp_path / RESULTS_JSON).read_text()
    assert main([*argv, "--resume"]) == 0  # nothing left to measure
    assert (tmp_path / RESULTS_JSON).read_text() == first
    capsys.readouterr()
    assert main(_argv(tiny_target_dir, prompt_file, tmp_path, "--batch-sizes", "1,4")) == 2
    assert "batch_sizes ([1, 2] -> [1, 4])" in capsys.readouterr().err
