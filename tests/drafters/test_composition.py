"""Composed drafters (``jetflow+ngram``): the union and its scoring, name resolution, lossless decoding."""

from __future__ import annotations

import math

import pytest
import torch
from jetflow.core.composition import HitRate, _Observation, compose, mix
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.contracts import DraftContext, TreeShape
from jetflow.core.engine import Engine
from jetflow.core.errors import ConfigError, PluginNotFoundError
from jetflow.core.registry import default_registry
from jetflow.core.tree import DraftTree
from jetflow.policies.best_first import BestFirst

from tests.core.test_engine import _reference
from tests.drafters.test_eagle import eagle_trainer

from .tiny_heads import jetflow_registered, quick_trainer, tiny_head

INF = float("-inf")


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with jetflow_registered():
        yield


@pytest.fixture(scope="module")
def trained_head(tiny_llama, tmp_path_factory):
    trainer = quick_trainer(tiny_llama, tmp_path_factory.mktemp("composition-train"), steps=30)
    return trainer.fit().final_checkpoint


def _log(values: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(v) if v > 0 else INF for v in values])


def test_mix_is_the_union_scored_as_one_mixture() -> None:
    head = (torch.tensor([[5, 6, 7], [5, 6, 7]]), torch.stack([_log([0.5, 0.3, 0.1])] * 2))
    lookup = (torch.tensor([[6, 9, 0], [0, 0, 0]]), torch.stack([_log([0.75, 0.25, 0]), _log([0, 0, 0])]))
    tokens, logprobs = mix(head, lookup, weight=0.4, k=3)
    # row 0: 6 is in both (0.6 * 0.3 + 0.4 * 0.75 = 0.48), 5 only in the head (0.6 * 0.5 = 0.3),
    # 9 only in the lookup (0.4 * 0.25 = 0.1) beats the head's 7 (0.6 * 0.1 = 0.06)
    assert tokens[0].tolist() == [6, 5, 9]
    assert torch.allclose(logprobs[0].exp(), torch.tensor([0.48, 0.3, 0.1]))
    # row 1: no lookup proposal, so the head keeps its own scale exactly
    assert tokens[1].tolist() == [5, 6, 7] and torch.equal(logprobs[1], head[1][1])
    assert (logprobs <= 0).all(), "scores stay log-probabilities: cumulative scores never rise"


def test_mix_marks_absent_proposals_and_repeats_no_token() -> None:
    head = (torch.tensor([[3, 4]]), _log([0.9, 0])[None])  # one real proposal, one absent
    lookup = (torch.tensor([[3, 3]]), _log([1.0, 0])[None])
    tokens, logprobs = mix(head, lookup, weight=0.5, k=4)
    assert tokens.shape == (1, 4) and tokens[0, 0] == 3
    assert logprobs[0, 0].exp().item() == pytest.approx(0.5 * 0.9 + 0.5 * 1.0)
    assert torch.isinf(logprobs[0, 1:]).all(), "one distinct token only"


def test_hit_rate_counts_only_nodes_on_the_written_path() -> None:
    rate = HitRate(prior=0.5, strength=2.0)
    assert rate.weight == 0.5
    record = rate.expect(root_position=3)  # root at index 3 of the tokens
    # nodes: the root (depth 0), a child on the written path (token 8), a child off it (token 9)
    record.append(
        _Observation(
            depths=torch.tensor([0, 1, 1]),
            paths=torch.tensor([[-1, -1], [8, -1], [9, -1]]),
            top=torch.tensor([8, 4, 8]),  # right at the root, wrong at node 1; node 2 is not judged
            proposed=torch.tensor([True, True, True]),
        )
    )
    rate.update(torch.tensor([1, 2, 3, 0, 8, 5]))  # the target wrote 8 then 5 after the root
    assert (rate.hits, rate.trials) == (1.0, 2.0)
    assert rate.weight == pytest.approx((1 + 0.5 * 2) / (2 + 2))


def test_the_registry_resolves_compositions_and_names_unknown_parts() -> None:
    registry = default_registry()
    composed = registry.get("drafter", "jetflow+ngram")
    assert composed.name == "jetflow+ngram" and composed is registry.get("drafter", "jetflow+ngram")
    assert composed.default_tree_policy == "best-first"
    params = composed.Params.model_validate({"ngram": {"max_ngram": 2}, "prior": 0.3})
    assert params.ngram.max_ngram == 2 and params.prior == 0.3
    with pytest.raises(
        PluginNotFoundError, match=r"unknown drafter 'nope'; known drafters: .*jetflow.*ngram"
    ):
        registry.get("drafter", "jetflow+nope")
    with pytest.raises(ConfigError, match="two different drafters"):
        compose((registry.get("drafter", "ngram"),) * 2)
    with pytest.raises(ConfigError, match="two different drafters"):
        registry.get("drafter", "jetflow+ngram+eagle")
    with pytest.raises(ConfigError, match=r"unknown drafter 'jetflow\+nope'.*known drafters"):
        build_config(GenerateConfig, {"drafter": "jetflow+nope"})


def _engine(target, **fields) -> Engine:
    return Engine(build_config(GenerateConfig, fields), target)


def _repetitive_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    motif = torch.randint(2, 256, (6,), generator=generator).tolist()
    return [motif * 3, torch.randint(2, 256, (7,), generator=generator).tolist(), [9]]


@pytest.mark.parametrize(("policy", "budget"), [("best-first", 3), ("best-first", 16), ("chain", 6)])
def test_jetflow_plus_ngram_is_lossless(tiny_llama, trained_head, policy: str, budget: int) -> None:
    engine = _engine(
        tiny_llama,
        drafter="jetflow+ngram",
        drafter_params={"jetflow": {"checkpoint": str(trained_head)}},
        tree={"policy": policy, "budget": budget, "width": 3},
        max_new_tokens=30,
        stop_at_eos=False,
    )
    accepted = 0
    for prompt in _repetitive_prompts():
        result = engine.generate(prompt)
        assert result.token_ids == _reference(tiny_llama, prompt, 30, eos=False), prompt
        accepted += sum(step.accepted for step in result.steps)
    assert accepted > 0
    assert engine.drafter.hit_rate.trials > 0, "the lookup's proposals were judged against the output"


def test_a_refreshing_head_is_refreshed_inside_the_composition(tiny_llama, tmp_path) -> None:
    head = tiny_head(tiny_llama, path_conditioning=0.5)
    checkpoint = quick_trainer(tiny_llama, tmp_path, head=head, steps=20).fit().final_checkpoint
    engine = _engine(
        tiny_llama,
        drafter="jetflow+ngram",
        drafter_params={"jetflow": {"checkpoint": str(checkpoint), "refresh": True}},
        tree={"budget": 8, "width": 3},
        max_new_tokens=24,
        stop_at_eos=False,
    )
    for prompt in _repetitive_prompts()[:2]:
        result = engine.generate(prompt)
        assert result.token_ids == _reference(tiny_llama, prompt, 24, eos=False), prompt
        assert all(step.draft_forwards == 2 for step in result.steps if step.budget), "block pass + refresh"


def test_either_order_is_lossless_and_best_first_trees_stay_nested(tiny_llama, trained_head) -> None:
    """``ngram+jetflow`` (the lookup first, the head weighted by its hit rate) decodes the same
    tokens, and best-first's budget-b tree is the b best nodes of a larger one."""
    fields = {
        "drafter": "ngram+jetflow",
        "drafter_params": {"jetflow": {"checkpoint": str(trained_head)}},
        "tree": {"budget": 8, "width": 3},
        "max_new_tokens": 24,
        "stop_at_eos": False,
    }
    engine = _engine(tiny_llama, **fields)
    prompt = _repetitive_prompts()[0]
    assert engine.generate(prompt).token_ids == _reference(tiny_llama, prompt, 24, eos=False)

    drafter = engine.drafter
    drafter.reset()
    tokens = torch.tensor(prompt)
    _, features = tiny_llama.prefill(tokens[:-1], drafter.feature_layers)
    session = drafter.begin(DraftContext(tokens, features, len(prompt) - 1))
    root = DraftTree.root(int(tokens[-1]))
    policy = BestFirst(BestFirst.Params())
    big = policy.build(session, root, TreeShape(budget=12, width=3, max_depth=6))
    small = policy.build(session, root, TreeShape(budget=5, width=3, max_depth=6))
    top = torch.sort(big.scores[1:], descending=True, stable=True).values[:5]
    assert torch.allclose(torch.sort(small.scores[1:], descending=True).values, top)


def test_eagle_plus_ngram_is_lossless(tiny_llama, tmp_path_factory) -> None:
    """A per-depth head (one forward per level, its own feature layers) composes the same way."""
    checkpoint = eagle_trainer(tiny_llama, tmp_path_factory.mktemp("eagle"), steps=20).fit().final_checkpoint
    engine = _engine(
        tiny_llama,
        drafter="eagle+ngram",
        drafter_params={"eagle": {"checkpoint": str(checkpoint)}},
        tree={"budget": 10, "width": 3},
        max_new_tokens=24,
        stop_at_eos=False,
    )
    assert engine.policy.name == "eagle-dynamic"
    for prompt in _repetitive_prompts()[:2]:
        result = engine.generate(prompt)
        assert result.token_ids == _reference(tiny_llama, prompt, 24, eos=False), prompt
        assert all(step.draft_forwards >= 1 for step in result.steps if step.budget)
