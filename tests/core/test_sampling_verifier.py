"""The ``sampling`` verifier is lossless: statistical tests against exact distributions.

A step is lossless when the tokens it emits, continued by sampling the target itself,
are distributed as the target samples them. On a tiny synthetic language model (vocab 4)
the test draws thousands of steps on deterministic (best-first) and sampled trees,
completes each to ``LENGTH`` tokens, and compares the counts with the exact distribution
of the first ``LENGTH`` tokens by a chi-square test at false-alarm rate ``ALPHA``. The same
test must reject deliberately wrong rules, so it is known to have the power to fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from jetflow.core.contracts import TreePolicy, TreeShape, Verifier
from jetflow.core.tree import DraftTree
from jetflow.policies.best_first import BestFirst
from jetflow.policies.sampled import Sampled, SampledParams
from jetflow.verifiers.sampling import Sampling, SamplingParams, sampling_distribution
from scipy import stats
from torch import Tensor
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

ALPHA = 1e-3  # false-alarm rate of every chi-square test here
VOCAB = 4
LENGTH = 3  # tokens compared: a tree of depth 2 plus the bonus token
DRAWS = 3000  # per test of a correct rule; wrong rules are caught with far fewer
WRONG_DRAWS = 1200
SHAPE = TreeShape(budget=6, width=3, max_depth=LENGTH - 1)


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test of ``counts`` against ``probs``; cells expecting under 5 draws are pooled.

    An outcome of probability zero that was drawn at all is a certain failure (p-value 0).
    """
    probs = np.asarray(probs, dtype=np.float64)
    expected = probs / probs.sum() * counts.sum()
    if counts[expected <= 0].sum() > 0:
        return 0.0
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    return float(stats.chisquare(observed[keep], expected[keep]).pvalue)


def _code(tokens: Tensor) -> Tensor:
    """Row index of each context (``[..., LENGTH - 1]`` token ids, ``-1`` padded on the right)."""
    powers = (VOCAB + 1) ** torch.arange(tokens.shape[-1])
    return ((tokens + 1) * powers).sum(dim=-1)


class SyntheticModel:
    """Target logits and a different draft distribution for every context of fewer than LENGTH tokens."""

    def __init__(self, seed: int, params: SamplingParams) -> None:
        generator = torch.Generator().manual_seed(seed)
        rows = (VOCAB + 1) ** (LENGTH - 1)
        self.target_logits = 1.5 * torch.randn(rows, VOCAB, generator=generator)
        self.target = sampling_distribution(self.target_logits, **params.model_dump())
        # A draft independent of the target: siblings are often rejected, so the residuals
        # and the update of q after each rejection decide the outcome.
        self.draft = torch.softmax(torch.randn(rows, VOCAB, generator=generator), dim=1)

    def contexts(self, tree: DraftTree, nodes: Tensor | None = None) -> Tensor:
        """Context row of each node (of ``nodes``, or all): its path's tokens, root excluded.

        Walks up the parents (as ``_code`` would weigh the path read root first) rather than
        through ``path_tokens``, which keeps thousands of draws fast.
        """
        nodes = torch.arange(tree.size) if nodes is None else nodes
        depth, cursor = torch.zeros_like(nodes), nodes
        while bool((cursor > 0).any()):
            depth += (cursor > 0).long()
            cursor = tree.parents[cursor].clamp(min=0)
        code, cursor, level = torch.zeros_like(nodes), nodes, depth
        while bool((level > 0).any()):
            live = level > 0
            weight = (VOCAB + 1) ** (level - 1).clamp(min=0)
            code += torch.where(live, (tree.tokens[cursor] + 1) * weight, 0)
            cursor, level = tree.parents[cursor].clamp(min=0), level - 1
        return code

    def exact(self) -> np.ndarray:
        """``[VOCAB ** LENGTH]`` target probability of every sequence of LENGTH tokens."""
        probs = np.ones(VOCAB**LENGTH)
        for index in range(VOCAB**LENGTH):
            sequence = np.unravel_index(index, (VOCAB,) * LENGTH)
            for position, token in enumerate(sequence):
                context = torch.tensor([*sequence[:position], *[-1] * (LENGTH - 1 - position)])
                probs[index] *= float(self.target[_code(context), token])
        return probs


class SyntheticSession:
    """A draft session over the synthetic model: top-k proposals and full distributions."""

    max_depth = LENGTH - 1

    def __init__(self, model: SyntheticModel) -> None:
        self.model = model

    def children(self, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
        logprobs, tokens = self.model.draft[self.model.contexts(tree, nodes)].log().topk(k, dim=1)
        return tokens, logprobs

    def distributions(self, tree: DraftTree, nodes: Tensor) -> Tensor:
        return self.model.draft[self.model.contexts(tree, nodes)]


def draw_sequences(
    verifier: Verifier, policy: TreePolicy, model: SyntheticModel, draws: int, record_q: bool = False
) -> np.ndarray:
    """Counts of the first LENGTH tokens over ``draws`` steps, each completed by the target itself."""
    generator = torch.Generator().manual_seed(1234)
    policy.reset(generator)
    session = SyntheticSession(model)
    counts = np.zeros(VOCAB**LENGTH, dtype=np.int64)
    tree = None
    for _ in range(draws):
        if tree is None or isinstance(policy, Sampled):  # a deterministic tree is built once
            tree = policy.build(session, DraftTree.root(0), SHAPE)
            if record_q:  # claim (wrongly) that top-k children were sampled from q
                expanded = torch.unique(tree.parents[1:])
                tree = tree.with_draft_probs(expanded, session.distributions(tree, expanded))
            logits = model.target_logits[model.contexts(tree)]
        decision = verifier.accept(tree, logits, generator)
        sequence = [*tree.tokens[decision.path[1:]].tolist(), decision.next_token]
        while len(sequence) < LENGTH:
            context = torch.tensor([*sequence, *[-1] * (LENGTH - 1 - len(sequence))])
            sequence.append(int(torch.multinomial(model.target[_code(context)], 1, generator=generator)))
        counts[np.ravel_multi_index(sequence[:LENGTH], (VOCAB,) * LENGTH)] += 1
    return counts


class AcceptWithP(Sampling):
    """Wrong: accepts a sampled child with probability p(x) instead of min(1, p(x) / q(x))."""

    @staticmethod
    def accept_probability(p_x: Tensor, q_x: Tensor) -> Tensor:
        return p_x


class DraftNotUpdated(Sampling):
    """Wrong: tests every sibling against the original q, as if siblings were drawn with replacement."""

    @staticmethod
    def without(q: Tensor, token: Tensor) -> Tensor:
        return q


class BonusFromP(Sampling):
    """Wrong: never removes a rejected child's mass, so later siblings and the bonus come from p."""

    @staticmethod
    def residual(p: Tensor, q: Tensor) -> Tensor:
        return p


PLAIN = SamplingParams()
SHAPED = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)


def _policy(kind: str) -> TreePolicy:
    return Sampled(SampledParams()) if kind == "sampled" else BestFirst(BestFirst.Params())


@pytest.mark.parametrize(
    ("tree_kind", "params"),
    [("deterministic", PLAIN), ("sampled", PLAIN), ("sampled", SHAPED)],
)
def test_emitted_tokens_follow_the_target_distribution(tree_kind: str, params: SamplingParams) -> None:
    model = SyntheticModel(seed=7, params=params)
    counts = draw_sequences(Sampling(params), _policy(tree_kind), model, DRAWS)
    assert chi_square_pvalue(counts, model.exact()) > ALPHA


@pytest.mark.parametrize(
    ("tree_kind", "wrong", "record_q"),
    [
        ("sampled", AcceptWithP, False),
        ("sampled", BonusFromP, False),
        ("sampled", DraftNotUpdated, False),
        ("deterministic", BonusFromP, False),
        ("deterministic", Sampling, True),  # the right rule fed a q the children did not come from
    ],
)
def test_the_test_rejects_wrong_rules(tree_kind: str, wrong: type[Sampling], record_q: bool) -> None:
    model = SyntheticModel(seed=7, params=PLAIN)
    counts = draw_sequences(wrong(PLAIN), _policy(tree_kind), model, WRONG_DRAWS, record_q=record_q)
    assert chi_square_pvalue(counts, model.exact()) < ALPHA


def test_steps_accept_drafted_tokens() -> None:
    """The trees above are not decoration: both rules accept drafted tokens most of the time."""
    model = SyntheticModel(seed=7, params=PLAIN)
    generator = torch.Generator().manual_seed(0)
    for policy in (_policy("deterministic"), _policy("sampled")):
        policy.reset(generator)
        accepted = []
        for _ in range(300):
            tree = policy.build(SyntheticSession(model), DraftTree.root(0), SHAPE)
            logits = model.target_logits[model.contexts(tree)]
            accepted.append(Sampling(PLAIN).accept(tree, logits, generator).accepted)
        assert np.mean(accepted) > 0.8 and max(accepted) == 2


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.6, 5, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.5), (2.0, 1, 1.0), (1.0, 0, 0.01)],
)
def test_sampling_distribution_matches_transformers_warpers(temperature, top_k, top_p) -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * 3
    logits[0, :4] = logits[0, 10]  # ties at the cut
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = torch.softmax(scores, dim=-1)
    torch.testing.assert_close(sampling_distribution(logits, temperature, top_k, top_p), expected)


def test_params_are_validated() -> None:
    for bad in ({"temperature": 0}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1}, {"seed": 3}):
        with pytest.raises(ValueError):
            SamplingParams.model_validate(bad)
