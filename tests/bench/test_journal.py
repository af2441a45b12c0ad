"""A data set stopped part-way resumes after its journaled samples, with the same figures."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from jetflow.bench.config import load_bench_config
from jetflow.bench.generation import Generation, Method
from jetflow.bench.journal import SampleJournal, journal_path
from jetflow.bench.machine import describe_machine
from jetflow.bench.methods import build_methods
from jetflow.bench.runner import BenchmarkRunner, load_samples
from jetflow.core.errors import ConfigError
from jetflow.core.target import Target

from tests.bench.test_runner import MAX_NEW, Corrupted


class Stop(Exception):
    """The process is killed."""


class Counting(Method):
    """``inner``, counting its timed calls (warm-ups are shorter) and killing the run after ``stop_after``."""

    def __init__(self, inner: Method, stop_after: int | None = None) -> None:
        self.inner, self.stop_after, self.calls = inner, stop_after, 0
        self.name, self.budget, self.policy = inner.name, inner.budget, inner.policy

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Generation:
        if max_new_tokens == MAX_NEW:
            if self.calls == self.stop_after:
                raise Stop
            self.calls += 1
        return self.inner.generate(prompt_ids, max_new_tokens)


@pytest.fixture()
def setup(bench_target: Target, prompt_file: Path):
    config = load_bench_config(
        None,
        {
            "datasets": [f"file:{prompt_file}"],
            "budgets": [6],
            "drafters": ["ngram"],
            "baselines": [],
            "max_new_tokens": MAX_NEW,
            "warmup_tokens": 2,
        },
    )
    return config, load_samples(config)


def _runner(config, target: Target, stop_after: int | None = None) -> tuple[BenchmarkRunner, Counting]:
    ar, ngram = build_methods(config, target)
    counted = Counting(ar, stop_after)
    return BenchmarkRunner(config, target, methods=[counted, ngram, Corrupted(ngram)]), counted


def _figures(runs: list[dict]) -> list[tuple]:
    """What does not depend on timing: tokens, steps, acceptance and divergences."""
    keys = ("method", "new_tokens", "steps", "n_turns", "accept_histogram", "divergences")
    return [tuple(str(run[key]) for key in keys) for run in runs]


def test_a_stopped_data_set_resumes_after_its_journaled_samples(
    bench_target: Target, setup, tmp_path: Path
) -> None:
    config, samples = setup
    (name,) = samples
    whole = _runner(config, bench_target)[0].run(samples)

    stopped, _ = _runner(config, bench_target, stop_after=1)  # killed at the second sample
    with pytest.raises(Stop):
        stopped.run(samples, journal_dir=tmp_path)
    path = journal_path(tmp_path, name)
    assert len(path.read_text().splitlines()) == 2  # the header and the first sample
    with path.open("a") as journal:
        journal.write('{"sample_id": "chat", "tu')  # a line cut off as the process died

    resumed, counted = _runner(config, bench_target)
    saved: list[int] = []
    results = resumed.run(
        samples, on_dataset=lambda r: saved.append(len(r.runs)), journal_dir=tmp_path, resume=True
    )
    assert counted.calls == 2, "only the second sample's two turns run again"
    assert _figures(results.runs) == _figures(whole.runs)
    assert not results.runs[2]["lossless"] and results.runs[2]["divergences"], "divergences survive"
    assert saved == [3] and not path.exists(), "the journal goes once its data set is saved"


def test_a_run_without_resume_starts_its_journal_anew(bench_target: Target, setup, tmp_path: Path) -> None:
    config, samples = setup
    stopped, _ = _runner(config, bench_target, stop_after=1)
    with pytest.raises(Stop):
        stopped.run(samples, journal_dir=tmp_path)
    fresh, counted = _runner(config, bench_target)
    fresh.run(samples, journal_dir=tmp_path)
    assert counted.calls == 3, "every turn of both samples measured again"


def test_a_journal_from_other_settings_another_machine_or_damaged_is_refused(
    bench_target: Target, setup, tmp_path: Path
) -> None:
    config, samples = setup
    (name,) = samples
    stopped, _ = _runner(config, bench_target, stop_after=1)
    with pytest.raises(Stop):
        stopped.run(samples, journal_dir=tmp_path)
    longer = config.model_copy(update={"max_new_tokens": MAX_NEW + 1})
    with pytest.raises(ConfigError, match="max_new_tokens"):
        _runner(longer, bench_target)[0].run(samples, journal_dir=tmp_path, resume=True)

    path = journal_path(tmp_path, name)
    header, sample = path.read_text().splitlines()
    moved = json.loads(header)
    moved["machine"]["cpu"] = "another processor"
    path.write_text(f"{json.dumps(moved)}\n{sample}\n")
    with pytest.raises(ConfigError, match="measured on another machine: cpu"):
        _runner(config, bench_target)[0].run(samples, journal_dir=tmp_path, resume=True)

    del moved["machine"]  # begun before the machine was recorded: taken as this machine's
    path.write_text(f"{json.dumps(moved)}\n{sample}\n")
    legacy, counted = _runner(config, bench_target)
    legacy.run(samples, journal_dir=tmp_path, resume=True)
    assert counted.calls == 2

    path.write_text(f"{header}\n{sample[:40]}\n{sample}\n")
    with pytest.raises(ConfigError, match="line 2 is damaged"):
        _runner(config, bench_target)[0].run(samples, journal_dir=tmp_path, resume=True)
    path.write_text("not json\n")
    with pytest.raises(ConfigError, match="not a jetflow sample journal"):
        _runner(config, bench_target)[0].run(samples, journal_dir=tmp_path, resume=True)


def test_one_data_set_is_journaled_by_one_process(bench_target: Target, setup, tmp_path: Path) -> None:
    config, samples = setup
    (name,) = samples
    runner = _runner(config, bench_target)[0]
    settings = runner.settings(samples)
    path = journal_path(tmp_path, name)
    with (
        SampleJournal.open(path, bench_target.name, settings, describe_machine(), resume=False),
        pytest.raises(ConfigError, match="another process is measuring"),
    ):
        runner.run(samples, journal_dir=tmp_path, resume=True)


def test_journal_names_are_files_even_for_paths() -> None:
    a, b = journal_path(Path("j"), "file:/x/a.jsonl"), journal_path(Path("j"), "file:/x_a.jsonl")
    assert a.parent == Path("j") and "/" not in a.name and a != b
