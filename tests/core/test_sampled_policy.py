"""The ``sampled`` tree policy and the draft distributions a tree carries."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from jetflow.core.contracts import TreeShape
from jetflow.core.errors import ConfigError
from jetflow.core.tree import DraftTree
from jetflow.policies.sampled import Sampled, SampledParams, sample_without_replacement, temper
from torch import Tensor

from .test_sampling_verifier import ALPHA, chi_square_pvalue

VOCAB = 30


def _distribution(path: tuple[int, ...]) -> Tensor:
    """A fixed, path-dependent next-token distribution with some zero entries."""
    generator = torch.Generator().manual_seed(hash(path) % (2**31))
    probs = torch.softmax(2 * torch.randn(VOCAB, generator=generator), dim=0)
    probs[:3] = 0.0
    return probs / probs.sum()


class PathSession:
    max_depth = None

    def distributions(self, tree: DraftTree, nodes: Tensor) -> Tensor:
        return torch.stack(
            [_distribution(tuple(tree.tokens[tree.path(n)[1:]].tolist())) for n in nodes.tolist()]
        )

    def children(self, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
        logprobs, tokens = self.distributions(tree, nodes).log().topk(k, dim=1)
        return tokens, logprobs


def _build(seed: int, shape: TreeShape, temperature: float = 1.0) -> DraftTree:
    policy = Sampled(SampledParams(temperature=temperature))
    policy.reset(torch.Generator().manual_seed(seed))
    return policy.build(PathSession(), DraftTree.root(0), shape)


def test_gumbel_top_k_draws_in_order_without_replacement() -> None:
    q = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    draws = 20000
    tokens, logq = sample_without_replacement(q.expand(draws, -1), 2, torch.Generator().manual_seed(0))
    assert torch.equal(logq, q.log()[tokens].float())
    assert bool((tokens[:, 0] != tokens[:, 1]).all()) and not bool((tokens == 4).any())
    counts = np.bincount((tokens[:, 0] * 5 + tokens[:, 1]).numpy(), minlength=25)
    # sequential draws: first a ~ q, then b ~ q without a
    exact = (q[:, None] * q[None, :] / (1 - q[:, None])).fill_diagonal_(0).flatten().numpy()
    assert chi_square_pvalue(counts, exact) > ALPHA
    with_replacement = (q[:, None] * q[None, :]).fill_diagonal_(0).flatten().numpy()
    assert chi_square_pvalue(counts, with_replacement) < ALPHA  # the test can tell the difference


def test_draws_past_the_support_are_marked_absent() -> None:
    q = torch.tensor([[0.0, 0.6, 0.4, 0.0]])
    tokens, logq = sample_without_replacement(q, 4, torch.Generator().manual_seed(1))
    assert set(tokens[0, :2].tolist()) == {1, 2} and torch.isinf(logq[0, 2:]).all()


@pytest.mark.parametrize(
    "shape", [TreeShape(16, 4, 16), TreeShape(10, 3, 2), TreeShape(7, 1, 16), TreeShape(40, 2, 4)]
)
def test_tree_respects_the_shape_and_records_what_it_sampled_from(shape: TreeShape) -> None:
    tree = _build(0, shape)
    assert tree.draft_size == min(shape.budget, sum(shape.width**d for d in range(1, shape.max_depth + 1)))
    assert tree.max_depth <= shape.max_depth
    children = torch.bincount(tree.parents[1:], minlength=tree.size)
    assert int(children.max()) <= shape.width
    for node in range(tree.size):
        kids = torch.nonzero(tree.parents == node).flatten()
        assert len(set(tree.tokens[kids].tolist())) == len(kids)  # distinct siblings
        if len(kids):
            expected = _distribution(tuple(tree.tokens[tree.path(node)[1:]].tolist()))
            torch.testing.assert_close(tree.draft_probs[node], expected)
            assert bool((expected[tree.tokens[kids]] > 0).all())
            torch.testing.assert_close(
                tree.scores[kids], tree.scores[node] + expected[tree.tokens[kids]].log()
            )
        else:
            assert not bool(tree.draft_probs[node].any())


def test_children_counts_follow_frontier_order_not_the_drawn_tokens() -> None:
    """With the budget cut mid-level, earlier frontier nodes are full and later ones empty."""
    tree = _build(3, TreeShape(budget=6, width=3, max_depth=2))
    counts = torch.bincount(tree.parents[1:], minlength=tree.size)
    assert counts[0] == 3 and sorted(counts[1:4].tolist()) == [0, 0, 3]
    expanded = int(torch.nonzero(counts[1:4]).flatten()[0]) + 1
    assert tree.scores[expanded] == tree.scores[1:4].max()  # the most probable frontier node


def test_same_seed_same_tree_and_temperature_is_recorded() -> None:
    shape = TreeShape(12, 3, 4)
    first, again, other = _build(5, shape), _build(5, shape), _build(6, shape)
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.parents, again.parents)
    assert not torch.equal(first.tokens, other.tokens)
    hot = _build(5, shape, temperature=2.0)
    expected = temper(_distribution(()).unsqueeze(0), 2.0)[0]
    torch.testing.assert_close(hot.draft_probs[0], expected)
    assert expected.max() < _distribution(()).max()


def test_a_session_without_distributions_is_a_clear_error() -> None:
    class TopKOnly:
        max_depth = None

        def children(self, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
            raise AssertionError("not reached")

    with pytest.raises(ConfigError, match="distributions"):
        Sampled(SampledParams()).build(TopKOnly(), DraftTree.root(0), TreeShape(4, 2, 2))


def test_draft_probs_follow_extend_and_select() -> None:
    tree = DraftTree.root(0).extend(torch.tensor([0, 0]), torch.tensor([5, 6]), torch.tensor([-0.1, -0.2]))
    assert tree.draft_probs is None
    q = torch.tensor([[0.1, 0.2, 0.7]])
    tree = tree.with_draft_probs(torch.tensor([0]), q)
    assert tree.draft_probs.shape == (3, 3) and torch.equal(tree.draft_probs[0], q[0])
    tree = tree.extend(torch.tensor([1]), torch.tensor([7]), torch.tensor([-0.3]))
    assert tree.draft_probs.shape == (4, 3) and not bool(tree.draft_probs[1:].any())
    tree = tree.with_draft_probs(torch.tensor([1]), q.flip(1))
    kept = tree.select(torch.tensor([True, True, False, True]))
    assert torch.equal(kept.draft_probs, tree.draft_probs[[0, 1, 3]])
    with pytest.raises(ValueError, match="draft_probs"):
        DraftTree(tree.tokens, tree.parents, tree.scores, draft_probs=torch.zeros(2, 3))
