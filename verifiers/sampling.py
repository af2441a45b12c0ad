"""``sampling``: lossless speculative sampling with temperature, top-k and top-p.

The target distribution ``p`` at every tree node is the target's logits after temperature,
top-k and top-p, in the order ``transformers`` applies them. From the root the verifier
walks down the tree, trying each node's children in node order (recursive rejection
sampling, Jeon et al. 2024); which rule applies depends on what the tree carries:

* **sampled children** (the node has a non-zero ``tree.draft_probs`` row ``q``: its children
  were drawn from ``q`` without replacement, as the ``sampled`` policy does): accept child
  ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``; on rejection
  ``p_{i+1} = norm(max(p_i - q_i, 0))`` and ``q_{i+1}`` is ``q_i`` without ``x_i``,
  renormalised, because the next sibling was drawn from exactly that.
* **deterministic children** (no ``draft_probs``, or a zero row: top-k proposals, a pure
  function of the context, as every built-in drafter gives): the same walk with ``q_i`` a
  point mass on ``x_i``: accept ``x_i`` with probability ``p_i(x_i)``, else drop ``x_i`` from
  ``p_i`` and renormalise. That is exactly "sample ``x ~ p`` and follow the child that
  matches". Recording a ``q`` for children that were *not* sampled from it would be lossy,
  so only a policy that really samples may record one.

When every child is rejected (or a node has none) the bonus token is drawn from the final
residual ``p``. In both cases the tokens a step emits are distributed exactly as the
target samples them; ``tests/core/test_sampling_verifier.py`` checks it with chi-square
tests, and checks that the tests catch deliberately wrong rules.
"""

from __future__ import annotations

import torch
from jetflow.core.contracts import Acceptance, Verifier
from jetflow.core.hookspecs import hookimpl
from jetflow.core.tree import DraftTree
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, gt=0, description="softmax temperature of the target")
    top_p: float = Field(1.0, gt=0, le=1, description="keep the smallest set of tokens with this mass")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 keeps all")


def sampling_distribution(
    logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> Tensor:
    """``[..., vocab]`` logits -> probabilities after temperature, then top-k, then top-p.

    Ties at the k-th logit are all kept, and top-p keeps every token whose more likely
    predecessors hold less than ``top_p`` of the mass, as ``transformers`` does.
    """
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before >= top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def children_table(tree: DraftTree) -> tuple[Tensor, Tensor]:
    """``(children, starts)``: node ``v``'s children are ``children[starts[v] : starts[v + 1]]``, in order."""
    children = torch.sort(tree.parents[1:], stable=True).indices + 1
    counts = torch.bincount(tree.parents[1:], minlength=tree.size)
    starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return children, starts


class Sampling(Verifier):
    name = "sampling"
    description = "lossless speculative sampling with temperature, top-k and top-p"
    Params = SamplingParams

    def accept(self, tree: DraftTree, logits: Tensor, generator: torch.Generator) -> Acceptance:
        params: SamplingParams = self.params  # type: ignore[assignment]
        probs = sampling_distribution(logits, params.temperature, params.top_k, params.top_p)  # [n, V]
        if tree.draft_probs is not None and tree.draft_probs.shape[1] != probs.shape[1]:
            raise ValueError(
                f"the tree's draft distributions span {tree.draft_probs.shape[1]} tokens, "
                f"the target's vocabulary {probs.shape[1]}"
            )
        children, starts = children_table(tree)
        path = [0]
        while True:
            node = path[-1]
            kids = children[starts[node] : starts[node + 1]]
            q = None if tree.draft_probs is None else tree.draft_probs[node].float()
            if q is not None and not bool(q.sum() > 0):
                q = None
            chosen, residual = self.try_children(probs[node].float().cpu(), q, tree.tokens[kids], generator)
            if chosen is None:
                bonus = int(torch.multinomial(residual, 1, generator=generator))
                return Acceptance(path=torch.tensor(path, dtype=torch.long), next_token=bonus)
            path.append(int(kids[chosen]))

    def try_children(
        self, p: Tensor, q: Tensor | None, tokens: Tensor, generator: torch.Generator
    ) -> tuple[int | None, Tensor]:
        """Recursive rejection over one node's children (``tokens``, ``[m]``, in sampling order).

        ``p`` is the target's ``[V]`` distribution, ``q`` the draft distribution the children were
        sampled from without replacement, or ``None`` for deterministic children. Returns the
        index of the accepted child, or ``None`` and the residual to draw the bonus token from.
        """
        for index, token in enumerate(tokens.tolist()):
            q_i = torch.zeros_like(p).index_fill_(0, torch.tensor([token]), 1.0) if q is None else q
            if float(torch.rand((), generator=generator)) < self.accept_probability(p[token], q_i[token]):
                return index, p
            p = self.residual(p, q_i)
            if q is not None:
                q = self.without(q, token)
        return None, p

    @staticmethod
    def accept_probability(p_x: Tensor, q_x: Tensor) -> float:
        """``min(1, p(x) / q(x))``; a token the draft could not draw counts as certain if p allows it."""
        return float((p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)).clamp(max=1.0))

    @staticmethod
    def without(q: Tensor, token: int) -> Tensor:
        """``q`` with ``token`` removed and renormalised: what the next sibling was drawn from."""
        q = q.index_fill(0, torch.tensor([token]), 0.0)
        return q / q.sum().clamp_min(torch.finfo(q.dtype).tiny)

    @staticmethod
    def residual(p: Tensor, q: Tensor) -> Tensor:
        """``norm(max(p - q, 0))``: what is left of ``p`` once a draw from ``q`` was rejected.

        Its mass is the rejection probability, so it is zero only where rejection cannot
        happen; should rounding still get there, ``p`` is kept.
        """
        rest = (p - q).clamp_min(0.0)
        mass = rest.sum()
        return rest / mass if bool(mass > 0) else p


@hookimpl
def jetflow_verifiers() -> list[type]:
    return [Sampling]
