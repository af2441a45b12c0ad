"""``jetflow bench``: bad input fails before the model loads; a run writes its outputs; a
real divergence is written down and then fails the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jetflow.bench import runner as runner_module
from jetflow.bench.results import BenchResults
from jetflow.cli.main import main
from jetflow.core.target import Target


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args, **_kwargs):
        raise AssertionError("the target must not load for bad input")

    monkeypatch.setattr(Target, "load", refuse)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--drafters", "ngram,nope"], "unknown drafter 'nope'; known drafters: "),
        (["--drafters", "ngram:zigzag"], "unknown tree policy 'zigzag'"),
        (["--datasets", "champ,gsm8k"], "unknown dataset 'gsm8k'"),
        (["--budgets", "8,x"], "budgets"),
        (["--budgets", "-1"], "budgets"),
        (["--limit", "0"], "limit"),
        (["--config", "/nonexistent/bench.toml"], "config file not found"),
        (["--datasets", "file:/nonexistent/prompts.jsonl"], "/nonexistent/prompts.jsonl"),
    ],
)
def test_bad_input_is_one_line_exit_2_without_loading(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    no_model_load: None,
    argv: list[str],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)  # the default --out, results/, is made before the data sets load
    code = main(["bench", "--no-progress", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("jetflow: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def _argv(tiny_target_dir: Path, prompt_file: Path, out: Path) -> list[str]:
    return [
        "bench",
        "--target",
        str(tiny_target_dir),
        "--dtype",
        "float32",
        "--datasets",
        f"file:{prompt_file}",
        "--drafters",
        "ngram,ngram:chain",
        "--budgets",
        "4",
        "--max-new-tokens",
        "8",
        "--out",
        str(out),
        "--no-progress",
    ]


def test_a_run_writes_results_report_and_plots(
    capsys: pytest.CaptureFixture[str], tiny_target_dir: Path, prompt_file: Path, tmp_path: Path
) -> None:
    code = main(_argv(tiny_target_dir, prompt_file, tmp_path))
    out, _ = capsys.readouterr()
    assert code == 0
    for name in ("results.json", "report.md", "tau_vs_budget.png", "speedup.png"):
        assert (tmp_path / name).is_file(), name
    results = json.loads((tmp_path / "results.json").read_text())
    assert [run["method"] for run in results["runs"]] == [
        "ar",
        "hf-generate",
        "hf-prompt-lookup",
        "ngram",
        "ngram:chain",
    ]
    assert results["settings"]["command"].startswith("jetflow bench --drafters ngram,ngram:chain")
    assert "ngram:chain B=4" in out and "wrote " in out


def test_a_real_divergence_exits_1_after_writing(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tiny_target_dir: Path,
    prompt_file: Path,
    tmp_path: Path,
) -> None:
    real_run = runner_module.run_benchmark

    def diverging(*args, **kwargs) -> BenchResults:
        results = real_run(*args, **kwargs)
        bug = {"sample_id": "loop", "turn": 0, "position": 2, "expected": 7, "got": 9, "logit_gap": 4.0}
        results.runs[-1].update(lossless=False, divergences=[{**bug, "kind": "bug"}])
        return results

    monkeypatch.setattr(runner_module, "run_benchmark", diverging)
    code = main(_argv(tiny_target_dir, prompt_file, tmp_path))
    out, err = capsys.readouterr()
    assert code == 1
    assert json.loads((tmp_path / "results.json").read_text())["runs"][-1]["lossless"] is False
    assert "lossless check failed (1 real divergences)" in err
    assert "ngram:chain budget 4 on file:" in err and "token 2 is 9, baseline has 7" in err
    assert "NOT LOSSLESS" in out


def test_resume_measures_nothing_twice_and_refuses_a_broken_file(
    capsys: pytest.CaptureFixture[str], tiny_target_dir: Path, prompt_file: Path, tmp_path: Path
) -> None:
    argv = _argv(tiny_target_dir, prompt_file, tmp_path)
    assert main(argv) == 0
    first = (tmp_path / "results.json").read_text()
    assert main([*argv, "--resume"]) == 0
    assert (tmp_path / "results.json").read_text() == first  # nothing measured, nothing recorded
    (tmp_path / "results.json").write_text('{"machine": {}')
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "not a complete jetflow results file" in err and "Traceback" not in err


def test_processes_with_different_data_sets_fill_one_results_file(
    tiny_target_dir: Path, prompt_file: Path, tmp_path: Path
) -> None:
    second = tmp_path / "second.jsonl"
    second.write_text(json.dumps({"id": "more", "prompt": "w7 w8 w9 w7 w8 w9"}) + "\n")
    out = tmp_path / "shared"
    argv = _argv(tiny_target_dir, prompt_file, out)
    assert main([*argv, "--resume"]) == 0
    only_first = BenchResults.read_json(out / "results.json")
    argv[argv.index(f"file:{prompt_file}")] = f"file:{second}"
    assert main([*argv, "--resume"]) == 0  # as a second process would, with its own ar
    both = BenchResults.read_json(out / "results.json")
    assert both.runs[: len(only_first.runs)] == only_first.runs
    assert {run["dataset"] for run in both.runs} == {f"file:{prompt_file}", f"file:{second}"}
    assert both.settings["datasets"] == [f"file:{prompt_file}", f"file:{second}"]
    report = (out / "report.md").read_text()
    assert f"file:{second}" in report and len(both.settings["commands"]) == 2
    assert all(f"* command: `{command}`" in report for command in both.settings["commands"])


def test_no_vllm_turns_off_what_the_config_file_turns_on(tmp_path: Path) -> None:
    from jetflow.bench.config import load_bench_config
    from jetflow.cli.bench import command_line

    file = tmp_path / "bench.toml"
    file.write_text('drafters = ["ngram"]\nvllm = true\n')
    off = load_bench_config(file, {"vllm": False})
    assert not off.vllm and command_line(off, str(file)).endswith("--no-vllm")  # the rerun stays off
    on = load_bench_config(file)
    assert on.vllm and command_line(on, str(file)).endswith("--vllm")
    assert "vllm" not in command_line(load_bench_config(None, {"drafters": ["ngram"]}), None)
