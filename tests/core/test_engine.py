"""The engine loop on tiny random targets: lossless against ``transformers.generate``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.registry import default_registry
from jetflow.core.target import Target

from . import oracle_drafter

settings.register_profile(
    "engine", deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module", autouse=True)
def _oracle_registered():
    registry = default_registry()
    registry.register(oracle_drafter)
    yield
    registry.unregister(oracle_drafter)


def _reference(target: Target, prompt: list[int], max_new_tokens: int, eos: bool = True) -> list[int]:
    kwargs = {} if eos else {"eos_token_id": None}
    with torch.inference_mode():
        out = target.model.generate(
            torch.tensor([prompt], device=target.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


def _engine(target: Target, **fields) -> Engine:
    return Engine(build_config(GenerateConfig, fields), target)


@settings(settings.get_profile("engine"), max_examples=12)
@given(
    prompt=st.lists(st.integers(2, 255), min_size=1, max_size=12),
    budget=st.integers(1, 24),
    width=st.integers(1, 4),
    policy=st.sampled_from(["chain", "best-first"]),
    hit_rate=st.floats(0.3, 1.0),
    seed=st.integers(0, 1000),
)
def test_oracle_trees_are_lossless(
    tiny_target: Target, prompt, budget, width, policy, hit_rate, seed
) -> None:
    new = 24
    expected = _reference(tiny_target, prompt, new, eos=False)
    engine = _engine(
        tiny_target,
        drafter="test-oracle",
        drafter_params={"reference": [*prompt, *expected], "hit_rate": hit_rate, "seed": seed},
        tree={"policy": policy, "budget": budget, "width": width},
        max_new_tokens=new,
        stop_at_eos=False,
    )
    result = engine.generate(prompt)
    assert result.token_ids == expected
    assert result.finish_reason == "length"
    assert sum(step.accepted + 1 for step in result.steps) >= new
    if hit_rate == 1.0:
        assert result.tau > 1.0


@pytest.mark.parametrize("policy", ["chain", "best-first"])
def test_ngram_is_lossless_and_accepts_on_repetitive_text(tiny_target: Target, policy: str) -> None:
    prompt = [7, 8, 9, 10, 11] * 3 + [7]
    expected = _reference(tiny_target, prompt, 32)
    result = _engine(
        tiny_target, drafter="ngram", tree={"policy": policy, "budget": 8}, max_new_tokens=32
    ).generate(prompt)
    assert result.token_ids == expected


def test_baseline_loop_equals_generate(tiny_target: Target) -> None:
    prompt = [3, 4, 5, 6]
    result = _engine(tiny_target, drafter="none", max_new_tokens=20).generate(prompt)
    assert result.token_ids == _reference(tiny_target, prompt, 20)
    assert result.tau == 1.0
    assert {step.budget for step in result.steps} == {0} and result.stats()["budgets"] is None


def test_max_new_tokens_is_exact_even_mid_path(tiny_llama: Target) -> None:
    prompt = [9, 10, 11]
    expected = _reference(tiny_llama, prompt, 40, eos=False)
    for limit in (1, 2, 5, 13):
        engine = _engine(
            tiny_llama,
            drafter="test-oracle",
            drafter_params={"reference": [*prompt, *expected], "hit_rate": 1.0},
            tree={"policy": "chain", "budget": 8},
            max_new_tokens=limit,
            stop_at_eos=False,
        )
        result = engine.generate(prompt)
        assert result.token_ids == expected[:limit]


def _perfect_chain_engine(target: Target, reference: list[int], **fields) -> Engine:
    """An engine whose oracle always drafts the true continuation as a chain of 8."""
    return _engine(
        target,
        drafter="test-oracle",
        drafter_params={"reference": reference, "hit_rate": 1.0},
        tree={"policy": "chain", "budget": 8},
        **fields,
    )


def test_eos_inside_an_accepted_path_ends_generation_there(tiny_llama: Target) -> None:
    prompt = [9, 10, 11]
    expected = _reference(tiny_llama, prompt, 12, eos=False)
    cut = 4
    # The oracle proposes the continuation with an EOS at position `cut`, and the target
    # (forced by a stop-token set) must end exactly there.
    engine = _perfect_chain_engine(tiny_llama, [*prompt, *expected], max_new_tokens=12)
    engine.target.__dict__["eos_token_ids"] = frozenset({expected[cut]})
    try:
        result = engine.generate(prompt)
    finally:
        del engine.target.__dict__["eos_token_ids"]
    assert result.token_ids == expected[: cut + 1]
    assert result.finish_reason == "eos"
    assert result.steps[0].accepted >= cut  # the EOS arrived inside one accepted path


def test_stop_string_ends_generation_right_after_it(tiny_llama: Target) -> None:
    prompt = [9, 10, 11]
    expected = _reference(tiny_llama, prompt, 12, eos=False)
    stop_word = tiny_llama.decode([expected[5]])
    first = next(i for i, t in enumerate(expected) if tiny_llama.decode([t]) == stop_word)
    engine = _perfect_chain_engine(
        tiny_llama, [*prompt, *expected], max_new_tokens=12, stop=(stop_word,), stop_at_eos=False
    )
    result = engine.generate(prompt)
    assert result.token_ids == expected[: first + 1]
    assert result.finish_reason == "stop"


@pytest.mark.parametrize("drafter", ["none", "perfect-chain"])
def test_a_stop_string_spanning_tokens_and_steps_ends_generation_where_it_completes(
    tiny_llama: Target, drafter: str
) -> None:
    prompt = [9, 10, 11]
    expected = _reference(tiny_llama, prompt, 16, eos=False)
    stop = tiny_llama.decode(expected[7:10])  # three tokens, and longer than the tail of one token
    cut = next(n for n in range(1, 17) if stop in tiny_llama.decode(expected[:n]))
    fields = {"max_new_tokens": 16, "stop": (stop,), "stop_at_eos": False}
    if drafter == "none":
        engine = _engine(tiny_llama, drafter="none", **fields)
    else:
        engine = _perfect_chain_engine(tiny_llama, [*prompt, *expected], **fields)
    result = engine.generate(prompt)
    assert result.token_ids == expected[:cut] and result.finish_reason == "stop"


def test_the_default_drafter_falls_back_to_ngram_where_no_head_is_shipped(tiny_llama: Target) -> None:
    from jetflow.core.config import DEFAULT_DRAFTER, FALLBACK_DRAFTER
    from jetflow.core.errors import JetflowError

    assert _engine(tiny_llama).config.drafter == FALLBACK_DRAFTER != DEFAULT_DRAFTER
    with pytest.raises(JetflowError, match="no jetflow head is shipped"):
        _engine(tiny_llama, drafter=DEFAULT_DRAFTER)  # asked for by name: no silent fallback
