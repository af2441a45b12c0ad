"""The ``sampling`` verifier in the engine, on a tiny random target.

Over many seeds, the first tokens the engine generates must follow the target's own
sampling distribution (chi-square test), for deterministic and sampled trees; a seed
fixes the output; and top-k 1 reduces to greedy decoding.
"""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np
import pytest
import torch
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.contracts import DraftContext, Drafter
from jetflow.core.engine import Engine
from jetflow.core.errors import ConfigError
from jetflow.core.hookspecs import hookimpl
from jetflow.core.registry import default_registry
from jetflow.core.target import Target
from jetflow.core.tree import DraftTree
from jetflow.policies import sampled
from jetflow.verifiers.sampling import sampling_distribution
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from . import oracle_drafter
from .test_sampling_verifier import ALPHA, chi_square_pvalue

PROMPT = [5, 6, 7, 8]
PREFIX = 2  # generated tokens whose joint distribution is tested
TOP_K = 3
SAMPLES = 600  # generations per chi-square test


class MixParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    noise: float = 0.4  # weight of a random distribution mixed into the target's
    seed: int = 0


class MixSession:
    """Proposes from the target's own next-token distribution at each node, mixed with noise."""

    max_depth = None

    def __init__(self, drafter: MixDrafter, tokens: Tensor) -> None:
        self.drafter, self.tokens = drafter, tokens
        self.params, self.generator = drafter.params, drafter.generator

    def _target_probs(self, tree: DraftTree, nodes: Tensor) -> Tensor:
        """``[f, V]`` target probabilities after each node, memoised across runs (contexts recur)."""
        memo = self.drafter.memo
        contexts = [
            tuple(self.tokens.tolist() + tree.tokens[tree.path(n)[1:]].tolist()) for n in nodes.tolist()
        ]
        missing = sorted({context for context in contexts if context not in memo})
        if missing:  # one level of one tree: equal lengths
            with torch.inference_mode():
                logits = self.drafter.target.model(torch.tensor(missing)).logits[:, -1].float()
            memo.update(zip(missing, torch.softmax(logits, dim=-1), strict=True))
        return torch.stack([memo[context] for context in contexts])

    def children(self, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
        logprobs, tokens = self._target_probs(tree, nodes).log().topk(k, dim=1)
        return tokens, logprobs

    def distributions(self, tree: DraftTree, nodes: Tensor) -> Tensor:
        probs = self._target_probs(tree, nodes)
        noise = torch.softmax(3 * torch.randn(probs.shape, generator=self.generator), dim=1)
        return (1 - self.params.noise) * probs + self.params.noise * noise


class MixDrafter(Drafter):
    name = "test-target-mix"
    description = "test drafter: the target's own distribution mixed with noise"
    Params = MixParams

    def __init__(self, params: MixParams, target: Target) -> None:
        super().__init__(params, target)
        self.memo: dict[tuple[int, ...], Tensor] = {}

    def reset(self) -> None:
        self.generator = torch.Generator().manual_seed(self.params.seed)

    def begin(self, context: DraftContext) -> MixSession:
        return MixSession(self, context.tokens)


@hookimpl
def jetflow_drafters() -> list[type]:
    return [MixDrafter]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    registry = default_registry()
    modules = [oracle_drafter, sys.modules[__name__]]
    if "sampled" not in registry.names("tree_policy"):  # until its entry point is installed
        modules.append(sampled)
    for module in modules:
        registry.register(module)
    yield
    for module in modules:
        registry.unregister(module)


def _greedy(target: Target, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = target.model.generate(
            torch.tensor([prompt], device=target.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def _engine(target: Target, **fields) -> Engine:
    return Engine(build_config(GenerateConfig, fields), target)


def _exact_prefix_distribution(target: Target, params: dict) -> dict[tuple[int, ...], float]:
    """The target's probability of every ``PREFIX``-token continuation of ``PROMPT``, by enumeration."""
    exact = {(): 1.0}
    for _ in range(PREFIX):
        grown = {}
        with torch.inference_mode():
            for prefix, mass in exact.items():
                logits = target.model(torch.tensor([[*PROMPT, *prefix]])).logits[0, -1]
                probs = sampling_distribution(logits, **params)
                for token in probs.nonzero().flatten().tolist():
                    grown[(*prefix, token)] = mass * float(probs[token])
        exact = grown
    return exact


@pytest.mark.parametrize("policy", ["best-first", "sampled"])
def test_generated_tokens_follow_the_target_distribution(tiny_llama: Target, policy: str) -> None:
    params = {"temperature": 1.0, "top_k": TOP_K}
    engine = _engine(
        tiny_llama,
        drafter="test-target-mix",
        tree={"policy": policy, "budget": 4, "width": 2, "max_depth": PREFIX - 1},
        verifier="sampling",
        verifier_params=params,
        max_new_tokens=PREFIX,
        stop_at_eos=False,
    )
    samples, accepted = Counter(), 0
    base = engine.config
    for seed in range(SAMPLES):
        engine.config = base.model_copy(update={"seed": seed})
        result = engine.generate(PROMPT)
        samples[tuple(result.token_ids)] += 1
        accepted += sum(step.accepted for step in result.steps)
    exact = _exact_prefix_distribution(tiny_llama, params)
    assert set(samples) <= set(exact), "a continuation the target cannot sample was generated"
    outcomes = sorted(exact)
    counts = np.array([samples[outcome] for outcome in outcomes])
    assert chi_square_pvalue(counts, np.array([exact[outcome] for outcome in outcomes])) > ALPHA
    assert accepted > SAMPLES // 5  # the trees were used


@pytest.mark.parametrize("policy", ["chain", "best-first", "sampled"])
def test_top_k_one_is_greedy_decoding(tiny_llama: Target, policy: str) -> None:
    expected = _greedy(tiny_llama, PROMPT, 24)
    result = _engine(
        tiny_llama,
        drafter="test-oracle",
        drafter_params={"reference": [*PROMPT, *expected], "hit_rate": 0.8},
        tree={"policy": policy, "budget": 8, "width": 2},
        verifier="sampling",
        verifier_params={"top_k": 1, "temperature": 0.5},
        max_new_tokens=24,
        stop_at_eos=False,
        seed=11,
    ).generate(PROMPT)
    assert result.token_ids == expected
    assert result.tau > 1.5


@pytest.mark.parametrize("policy", ["best-first", "sampled"])
def test_a_seed_fixes_the_output(tiny_llama: Target, policy: str) -> None:
    def run(seed: int) -> list[int]:
        return (
            _engine(
                tiny_llama,
                drafter="test-target-mix",
                tree={"policy": policy, "budget": 6, "width": 2},
                verifier="sampling",
                verifier_params={"temperature": 1.5},
                max_new_tokens=16,
                stop_at_eos=False,
                seed=seed,
            )
            .generate(PROMPT)
            .token_ids
        )

    first = run(3)
    assert run(3) == first
    assert len({tuple(run(seed)) for seed in range(4, 8)} | {tuple(first)}) >= 4


def test_sampled_policy_needs_distributions(tiny_llama: Target) -> None:
    engine = _engine(tiny_llama, drafter="ngram", tree={"policy": "sampled"}, verifier="sampling")
    with pytest.raises(ConfigError, match="distributions"):
        engine.generate(PROMPT, max_new_tokens=4)
