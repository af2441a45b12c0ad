"""vLLM's bench methods without vLLM: step accounting, per-engine references, worker failures, report."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace

import pytest
from jetflow.bench.config import load_bench_config
from jetflow.bench.generation import Generation
from jetflow.bench.methods import EngineMethod, build_methods
from jetflow.bench.report import render_markdown
from jetflow.bench.runner import BenchmarkRunner, load_samples
from jetflow.bench.vllm_methods import VllmWorker, accepted_per_step
from jetflow.core.errors import JetflowError

from tests.bench.conftest import chat_target, words


def test_steps_and_acceptance_are_rebuilt_from_vllms_counters() -> None:
    # 10 tokens, 3 drafts: two accepted 1 token, one accepted 3 (per position: 3, 1, 1)
    reply = {"token_ids": list(range(10)), "accepted_tokens": 5, "drafts": 3, "accepted_per_pos": [3, 1, 1]}
    accepted = accepted_per_step(reply)
    assert sorted(accepted) == [0, 0, 1, 1, 3]  # 2 steps drafted nothing (prefill, no lookup match)
    assert len(accepted) == 10 - 5 and sum(accepted) == 5  # every step emits accepted + 1 tokens
    plain = {"token_ids": [7] * 4, "accepted_tokens": 0, "drafts": 0, "accepted_per_pos": []}
    assert accepted_per_step(plain) == (0, 0, 0, 0)


class FakeVllm:
    """A method measured against ``vllm``: ``ar``'s tokens with one changed (another engine's rounding)."""

    reference = "vllm"

    def __init__(self, name: str, inner: EngineMethod, slower: float = 1.0, changed: int | None = 2) -> None:
        self.name, self.budget, self.policy, self.left_out = name, None, None, {"eagle": "in_proj differs"}
        self.inner, self.slower, self.changed = inner, slower, changed

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Generation:
        generation = self.inner.generate(prompt_ids, max_new_tokens)
        tokens = list(generation.token_ids)
        if self.changed is not None and len(tokens) > 2:
            tokens[2] = (tokens[2] + 1) % 200 + 2
        return replace(generation, token_ids=tuple(tokens), wall_s=generation.wall_s * self.slower)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text(json.dumps({"id": "p", "prompt": words(3, 4, 5, 6, 3, 4, 5)}) + "\n")
    return load_bench_config(None, {"datasets": [f"file:{path}"], "drafters": [], "max_new_tokens": 8})


def test_vllm_methods_are_checked_and_timed_against_plain_vllm(config) -> None:
    target = chat_target()
    ar = build_methods(config, target)[0]
    methods = [
        ar,
        FakeVllm("vllm", ar, slower=2.0),
        FakeVllm("vllm-same", ar),
        FakeVllm("vllm-bad", ar, changed=None),
    ]
    results = BenchmarkRunner(config.model_copy(update={"vllm": True}), target, methods=methods).run(
        load_samples(config)
    )
    runs = {run["method"]: run for run in results.runs}
    assert (
        runs["vllm"]["reference"] == "vllm" and runs["vllm"]["lossless"]
    )  # differs from ar: not its reference
    assert runs["vllm-same"]["lossless"] and runs["vllm-same"]["reference"] == "vllm"
    assert runs["vllm-bad"]["divergences"]  # ar's tokens are not vllm's: compared with vllm
    assert runs["vllm-same"]["speedup_vs_reference"] == pytest.approx(
        runs["vllm-same"]["tokens_per_s"] / runs["vllm"]["tokens_per_s"]
    )
    assert runs["ar"]["reference"] == "ar" and runs["ar"]["speedup_vs_reference"] == 1.0
    assert results.settings["left_out"] == {"eagle": "in_proj differs"}
    report = render_markdown(results)
    assert "## vLLM beside jetflow" in report and "over `vllm`" in report and "in_proj differs" in report


def test_settings_without_vllm_keep_their_old_keys(config) -> None:
    """Results written before the vLLM fields existed still resume."""
    target = chat_target()
    settings = BenchmarkRunner(config, target, methods=build_methods(config, target)[:1]).settings({})
    assert "vllm" not in settings and "left_out" not in settings


def test_a_worker_that_dies_is_a_clear_error(tmp_path, monkeypatch) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'vllm: no such model' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("JETFLOW_VLLM_PYTHON", str(fake))
    with pytest.raises(JetflowError, match=r"exited \(3\): vllm: no such model"):
        VllmWorker({"model": "x"}, tmp_path / "worker.log")
