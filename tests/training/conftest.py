"""Fixtures of the training tests: the ``jetflow data`` commands run against a tiny target, a tiny
world for ``train`` (the tiny target and its in-memory corpus), and a ticking clock for the
trainer's time accounting."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from jetflow.cli import data as data_cli
from jetflow.core.target import Target
from jetflow.drafters.training import run as training_run
from jetflow.drafters.training import trainer as trainer_module

from tests.conftest import make_tiny_target
from tests.drafters.tiny_heads import jetflow_registered, regenerated_store

#: makes the tiny data target: (chat template, prompt-file records, benchmark texts by ``every_turn``)
TinyDataTarget = Callable[[str, list[dict], dict[bool, set[str]]], tuple[Target, Path]]


@pytest.fixture
def tiny_data_target(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[TinyDataTarget]:
    """Route ``Target.load`` to a tiny target and the benchmark texts to known ones.

    The returned function takes the target's chat template, the records of a prompt file
    (written to ``tmp_path``) and what ``benchmark_prompt_texts(every_turn)`` returns for
    each ``every_turn``; it gives the target and the prompt file. The commands run with
    ``--threads 1``, so torch's thread count is restored afterwards.
    """
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path / "cache"))

    def make(chat_template: str, records: list[dict], benchmark: dict[bool, set[str]]) -> tuple[Target, Path]:
        target = make_tiny_target("llama", seed=7)
        target.tokenizer.chat_template = chat_template
        monkeypatch.setattr(data_cli.Target, "load", classmethod(lambda cls, spec, dtype=None: target))
        monkeypatch.setattr(
            data_cli.prompt_sets, "benchmark_prompt_texts", lambda every_turn=False: benchmark[every_turn]
        )
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(record) + "\n" for record in records))
        return target, prompts

    threads = torch.get_num_threads()
    yield make
    torch.set_num_threads(threads)


@pytest.fixture
def ticking_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's clock advances one second per reading, so tests of its time accounting
    do not depend on how fast this machine runs the steps."""
    ticks = itertools.count(start=0.0, step=1.0)
    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))


@pytest.fixture
def tiny_world(tiny_llama, monkeypatch):
    """`Target.load` gives the tiny target and the feature cache is the in-memory miniature corpus."""
    monkeypatch.setattr(Target, "load", classmethod(lambda cls, *a, **k: tiny_llama))
    monkeypatch.setattr(training_run, "open_store", lambda *a, **k: regenerated_store(tiny_llama))
    with jetflow_registered():
        yield
