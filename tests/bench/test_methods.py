"""Compared methods: the lineup, the engine wrapper and the transformers baselines' probe."""

from __future__ import annotations

import pytest
from jetflow.bench.config import load_bench_config
from jetflow.bench.hf_baselines import ForwardProbe
from jetflow.bench.methods import build_methods
from jetflow.core.target import Target

from tests.bench.conftest import words


@pytest.mark.parametrize(
    ("starts", "prompt_len", "new_tokens", "accepted"),
    [
        ([0, 5, 6, 7], 5, 4, (0, 0, 0, 0)),  # plain greedy: one token per forward
        ([0, 7, 8, 12], 5, 9, (2, 0, 3, 0)),  # prompt lookup: 3, 1, 4, then a last 1 token
        ([0], 5, 3, (2,)),  # everything accepted in the prefill forward
        ([0, -1], 5, 3, None),  # a forward without positions: unknown
        ([0, 4], 5, 3, None),  # inconsistent positions: no histogram rather than a wrong one
        ([], 5, 0, None),
    ],
)
def test_probe_turns_forward_starts_into_accepted_lengths(
    starts: list[int], prompt_len: int, new_tokens: int, accepted: tuple[int, ...] | None
) -> None:
    assert ForwardProbe(starts=starts).accepted(prompt_len, new_tokens) == accepted


def test_lineup_has_ar_first_then_baselines_then_drafters(bench_target: Target) -> None:
    config = load_bench_config(None, {"drafters": ["ngram", "ngram:chain"], "budgets": [4, 8]})
    methods = build_methods(config, bench_target)
    assert all(m.reference == "ar" and not m.left_out for m in methods), "the Method protocol's defaults"
    lineup = [(m.name, m.budget, m.policy) for m in methods]
    assert lineup == [
        ("ar", None, None),
        ("hf-generate", None, None),
        ("hf-prompt-lookup", None, None),
        ("ngram", 4, "best-first"),
        ("ngram", 8, "best-first"),
        ("ngram:chain", 4, "chain"),
        ("ngram:chain", 8, "chain"),
    ]


def test_every_method_decodes_the_same_greedy_tokens(bench_target: Target) -> None:
    config = load_bench_config(None, {"drafters": ["ngram"], "budgets": [6]})
    prompt = bench_target.encode_prompt(words(*[3, 4, 5, 6] * 6))
    generations = {m.name: m.generate(prompt, 16) for m in build_methods(config, bench_target)}
    reference = generations["ar"].token_ids
    assert len(reference) > 0
    for name, generation in generations.items():
        assert generation.token_ids == reference, name
        assert generation.wall_s > 0 and generation.steps >= 1
        assert generation.verify_s <= generation.wall_s
        if generation.accepted is not None:
            assert len(generation.accepted) == generation.steps
            assert sum(generation.accepted) + generation.steps >= len(reference)
    assert generations["hf-generate"].steps == len(reference)
    assert generations["hf-generate"].accepted == (0,) * len(reference)
    assert generations["hf-generate"].draft_s == 0.0
    assert generations["ngram"].steps < len(reference)  # the repetitive prompt is drafted well
    assert generations["hf-prompt-lookup"].steps < len(reference)
