"""The pytest plugin: ``--benchmark`` gates benchmarks, coexists with pytest-benchmark's options,
and runs the comparison suite with tau and speedup in each record's extra_info.

Each test runs pytest in a subprocess, as a user would. The plugin is loaded with ``-p``
until the package registers it through the ``pytest11`` entry point (loading it both ways
would register it twice).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

PLUGIN = "jetflow.bench.pytest_plugin"
SUITE = Path(__file__).with_name("test_benchmarks.py")


def _pytest(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    installed = any(ep.value == PLUGIN for ep in entry_points(group="pytest11"))
    command = [
        sys.executable,
        "-m",
        "pytest",
        *([] if installed else ["-p", PLUGIN]),
        "-p",
        "no:cacheprovider",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny models: one thread is fastest
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def micro(tmp_path: Path) -> Path:
    """A plain pytest-benchmark test outside jetflow's suite."""
    (tmp_path / "test_micro.py").write_text(
        "def test_sum(benchmark):\n    assert benchmark(sum, range(10)) == 45\n\n"
        "def test_plain():\n    assert True\n"
    )
    return tmp_path


def test_flag_sits_beside_pytest_benchmark_options(micro: Path) -> None:
    done = _pytest("--help", cwd=micro)
    assert done.returncode == 0, done.stderr
    assert "--benchmark " in done.stdout and "--bench-config" in done.stdout
    assert "--benchmark-json" in done.stdout and "--benchmark-compare" in done.stdout


def test_benchmarks_are_skipped_without_the_flag(micro: Path) -> None:
    done = _pytest("-q", "-rs", cwd=micro)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 1 skipped" in done.stdout and "run with --benchmark" in done.stdout
    ran = _pytest("-q", "--benchmark", cwd=micro)
    assert ran.returncode == 0 and "2 passed" in ran.stdout, ran.stdout + ran.stderr


def test_suite_runs_with_json_and_compare(tiny_target_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    config = tmp_path / "suite.toml"
    config.write_text(
        f'target = "{tiny_target_dir}"\ndtype = "float32"\ndatasets = ["file:{prompt_file}"]\n'
        'drafters = ["ngram"]\nbudgets = [4]\nmax_new_tokens = 6\nbaselines = ["hf-prompt-lookup"]\n'
    )
    report, storage = tmp_path / "bench.json", tmp_path / "storage"
    common = ["-q", "--benchmark", "--bench-config", str(config), "--bench-rounds", "2"]
    common += [f"--benchmark-storage=file://{storage}", str(SUITE)]
    first = _pytest(*common, f"--benchmark-json={report}", "--benchmark-autosave", cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "3 passed" in first.stdout

    records = {b["param"]: b for b in json.loads(report.read_text())["benchmarks"]}
    assert set(records) == {f"file:prompts-{name}" for name in ("ar", "hf-prompt-lookup", "ngram-B4")}
    for record in records.values():
        assert record["stats"]["rounds"] == 2
        assert {"tau", "speedup_vs_ar", "tokens_per_s", "lossless"} <= set(record["extra_info"])
        assert record["extra_info"]["lossless"] is True and record["group"] == f"file:{prompt_file}"
    assert records["file:prompts-ngram-B4"]["extra_info"]["budget"] == 4

    second = _pytest(*common, "--benchmark-compare", cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "0001_" in second.stdout  # the saved run it compared against


def test_a_bad_suite_config_is_a_usage_error(tmp_path: Path) -> None:
    config = tmp_path / "suite.toml"
    config.write_text('drafters = ["nope"]\n')
    done = _pytest("--benchmark", "--bench-config", str(config), str(SUITE), cwd=tmp_path)
    assert done.returncode == 4  # pytest's usage-error exit code
    assert "unknown drafter 'nope'" in done.stderr


def test_suite_gains_the_batch_axis(tiny_target_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    config = tmp_path / "suite.toml"
    config.write_text(
        f'target = "{tiny_target_dir}"\ndtype = "float32"\ndatasets = ["file:{prompt_file}"]\n'
        'drafters = ["ngram"]\nbudgets = [4]\nmax_new_tokens = 6\n'
    )
    report = tmp_path / "bench.json"
    common = ["-q", "--benchmark", "--bench-config", str(config), "--bench-rounds", "1", str(SUITE)]
    done = _pytest(*common, "--bench-batch-sizes", "2,1", f"--benchmark-json={report}", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 passed" in done.stdout  # hf-prompt-lookup does not batch

    records = {b["param"]: b for b in json.loads(report.read_text())["benchmarks"]}
    methods = ("ar", "hf-generate", "ngram-B4")
    assert set(records) == {f"file:prompts-{method}-batch{size}" for size in (1, 2) for method in methods}
    for record in records.values():
        info = record["extra_info"]
        assert info["lossless"] is True and info["speedup_vs_ar"] > 0 and info["mean_rows"] >= 1
        assert record["param"].endswith(f"batch{info['batch_size']}")
    drafted = records["file:prompts-ngram-B4-batch2"]["extra_info"]
    assert drafted["speedup_vs_hf_generate"] > 0 and drafted["mean_batch_budget"] > 0

    bad = _pytest("--benchmark", "--bench-batch-sizes", "0", str(SUITE), cwd=tmp_path)
    assert bad.returncode == 4 and "batch_sizes: a batch size is an integer >= 1, got 0" in bad.stderr
