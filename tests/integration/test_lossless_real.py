"""Lossless greedy decoding on the real target against ``transformers.generate`` (fp32).

Exact on the plain kernels. Packed fp32 weights (every CPU's default) multiply one row and a
tree's rows with different kernels, so there a divergence is classified as the bench does: a
rounding tie within the fp32 tolerance passes, anything else fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jetflow.bench.lossless import DEFAULT_TIE_TOLERANCE, LosslessChecker
from jetflow.core import calibration as cal
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.target import Target
from jetflow.data.prompt_sets import load_dataset_samples

from tests.core.test_adaptive import calibration_record

pytestmark = pytest.mark.integration

#: long enough for contexts past 300 tokens and hundreds of verified trees; CI keeps it at 96
NEW_TOKENS = 96
# the previous jetflow recipe's converged head, trained for the refresh (the shipped one is not)
PATH_CONDITIONED_HEAD = Path(__file__).parents[1] / "fixtures/heads/jetflow-forward-kl"


def assert_lossless(target: Target, sample: str, ids: list[int], expected: list[int], got: list[int]) -> None:
    divergence = LosslessChecker(target, DEFAULT_TIE_TOLERANCE).check(sample, 0, ids, expected, got)
    assert divergence is None or divergence.kind == "tie", f"{sample}: differs from generate: {divergence}"


@pytest.fixture(scope="module")
def cases(real_target: Target) -> list[tuple[str, list[int], list[int]]]:
    """Ten real prompts (5 HumanEval, 5 MT-Bench) and the greedy continuation of `generate`."""
    samples = load_dataset_samples("humaneval", 5) + load_dataset_samples("mtbench", 5)
    found = []
    for sample in samples:
        ids = real_target.encode_prompt(sample.messages())
        with torch.inference_mode():
            prompt = torch.tensor([ids], device=real_target.device)
            out = real_target.model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        found.append((sample.id, ids, out[0, len(ids) :].tolist()))
    return found


@pytest.mark.parametrize(("policy", "budget", "half"), [("chain", 6, 0), ("best-first", 10, 1)])
def test_speculative_output_equals_generate_fp32(
    real_target: Target, cases, policy: str, budget: int, half: int
) -> None:
    """Each policy on alternate prompts, so that every prompt is decoded once by one of them."""
    config = build_config(
        GenerateConfig,
        {"drafter": "ngram", "tree": {"policy": policy, "budget": budget}, "max_new_tokens": NEW_TOKENS},
    )
    engine = Engine(config, real_target)
    accepted = 0
    for sample_id, ids, expected in cases[half::2]:
        result = engine.generate(ids)
        assert_lossless(real_target, sample_id, ids, expected, result.token_ids)
        accepted += sum(step.accepted for step in result.steps)
    assert accepted > 0, "the drafter never got a token accepted: trees were not exercised"


@pytest.mark.parametrize(
    ("drafter", "policy", "budget", "params"),
    [
        ("jetflow", "best-first", 16, {}),
        ("jetflow", "best-first", 16, {"checkpoint": str(PATH_CONDITIONED_HEAD), "refresh": True}),
        ("dflash", "chain", 7, {}),
        ("eagle", "eagle-dynamic", 16, {}),
    ],
    ids=["jetflow", "jetflow-refresh", "dflash", "eagle"],
)
def test_shipped_heads_are_lossless_fp32(
    real_target: Target, cases, drafter: str, policy: str, budget: int, params: dict
) -> None:
    """Every shipped learned head (and the refresh on a head trained for it), on three of the
    prompts (two HumanEval, one MT-Bench)."""
    fields = {"drafter": drafter, "drafter_params": params, "tree": {"policy": policy, "budget": budget}}
    engine = Engine(build_config(GenerateConfig, fields | {"max_new_tokens": NEW_TOKENS}), real_target)
    accepted = 0
    for sample_id, ids, expected in cases[::4]:
        result = engine.generate(ids)
        assert_lossless(real_target, sample_id, ids, expected, result.token_ids)
        accepted += sum(step.accepted for step in result.steps)
    assert accepted > 0, f"{drafter} never got a token accepted"


def test_an_adaptive_budget_is_lossless_while_it_switches_budgets(
    real_target: Target, cases, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped jetflow head under an adaptive budget that moves between no drafting and
    trees (a hand-written calibration where they tie), on four prompts."""
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path))
    config = build_config(GenerateConfig, {"tree": {"budget": "auto"}, "max_new_tokens": NEW_TOKENS})
    taus, cost_ms = {0: 1.0, 2: 1.2, 8: 1.3}, {0: 60.0, 2: 72.0, 8: 78.0}
    cal.save_calibration(calibration_record(cal.key_for(config, real_target), taus, cost_ms))
    engine = Engine.from_cache(config, real_target)
    assert engine.budget_source == "adaptive"
    used: set[int] = set()
    for sample_id, ids, expected in cases[::3]:
        result = engine.generate(ids)
        assert_lossless(real_target, sample_id, ids, expected, result.token_ids)
        used |= {step.budget for step in result.steps}
    assert 0 in used and len(used) > 1, f"the budget never switched: {used}"


def test_jetflow_is_the_default_drafter_for_the_embedded_target(real_target: Target) -> None:
    assert Engine(GenerateConfig(), real_target).config.drafter == "jetflow"


@pytest.mark.parametrize(
    ("drafter", "policy", "budget"), [("jetflow+ngram", "best-first", 4), ("eagle", "eagle-dynamic", 6)]
)
def test_every_row_of_a_batch_is_lossless_fp32(
    real_target: Target, cases, drafter: str, policy: str, budget: int
) -> None:
    """Five prompts, three rows at a time (rows refilled as they finish), half the tokens: each row's
    answer is ``generate``'s on its prompt alone (a prefix of its ``NEW_TOKENS``), divergences classified as
    for one sequence. The block head batches its drafts in one forward, EAGLE row by row."""
    new = NEW_TOKENS // 2
    fields = {"drafter": drafter, "tree": {"policy": policy, "budget": budget}, "max_new_tokens": new}
    engine = Engine(build_config(GenerateConfig, fields), real_target)
    chosen = cases[::2]
    results = engine.generate_batch([ids for _, ids, _ in chosen], batch_size=3)
    for (sample_id, ids, expected), result in zip(chosen, results, strict=True):
        assert_lossless(real_target, sample_id, ids, expected[:new], result.token_ids)
    steps = [step for result in results for step in result.steps]
    assert max(step.rows for step in steps) == 3
    assert sum(step.accepted for step in steps) > 0, f"{drafter} never got a token accepted"
