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
  point mass on ``x_i`` accepts ``x_i`` with probability ``p_i(x_i)``, else drops ``x_i`` from
  ``p_i``. That is exactly "sample ``x ~ p`` and follow the child that matches", which is
  what runs: one draw per visited node, and when no child matches, the bonus from ``p``
  without the children (the residual against their point masses). Recording a ``q`` for
  children that were *not* sampled from it would be lossy, so only a policy that really
  samples may record one.

When every child is rejected (or a node has none) the bonus token is drawn from the final
residual ``p``. In both cases the tokens a step emits are distributed exactly as the
target samples them; ``tests/core/test_sampling_verifier.py`` checks it with chi-square
tests, and checks that the tests catch deliberately wrong rules.

Only the nodes the walk visits (the accepted path and the node after it) need ``p``, so it
is computed for them alone, one row at a time, on the logits' device; the run's generator
must live on that device too (the engine makes it so).
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
        probs = _nucleus(probs, top_p)
    return probs


#: tokens sorted first when cutting the nucleus; doubled until the cut lies among them
NUCLEUS_START = 256


def _nucleus(probs: Tensor, top_p: float) -> Tensor:
    """Zero every token whose more likely predecessors hold ``top_p`` of the mass, renormalise.

    The nucleus is usually small, so only the ``k`` most likely tokens are sorted, ``k``
    doubling until every row's cut lies among them (at most the whole vocabulary).
    """
    vocab = probs.shape[-1]
    k = min(NUCLEUS_START, vocab)
    while True:
        top, order = probs.topk(k, dim=-1)  # sorted, most likely first
        before = top.cumsum(dim=-1) - top  # mass of the more likely tokens
        if k == vocab or bool((before[..., -1] >= top_p).all()):
            break
        k = min(2 * k, vocab)
    kept = torch.zeros_like(probs).scatter(-1, order, top.masked_fill(before >= top_p, 0.0))
    return kept / kept.sum(dim=-1, keepdim=True)


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
        if tree.draft_probs is not None and tree.draft_probs.shape[1] != logits.shape[1]:
            raise ValueError(
                f"the tree's draft distributions span {tree.draft_probs.shape[1]} tokens, "
                f"the target's vocabulary {logits.shape[1]}"
            )
        device = generator.device
        children, starts = (part.tolist() for part in children_table(tree))
        tokens = tree.tokens.to(device)
        path = [0]
        while True:  # one iteration per visited node: the accepted path and the node after it
            node = path[-1]
            kids = children[starts[node] : starts[node + 1]]
            p = sampling_distribution(logits[node].to(device), params.temperature, params.top_k, params.top_p)
            q = None if tree.draft_probs is None else tree.draft_probs[node].to(device, torch.float32)
            if q is not None and not bool(q.sum() > 0):
                q = None
            chosen, residual = self.try_children(p, q, tokens[kids], generator)
            if chosen is None:
                bonus = int(torch.multinomial(residual, 1, generator=generator))
                return Acceptance(
                    path=torch.tensor(path, dtype=torch.long, device=tree.device), next_token=bonus
                )
            path.append(kids[chosen])

    def try_children(
        self, p: Tensor, q: Tensor | None, tokens: Tensor, generator: torch.Generator
    ) -> tuple[int | None, Tensor]:
        """Recursive rejection over one node's children (``tokens``, ``[m]``, in sampling order).

        ``p`` is the target's ``[V]`` distribution, ``q`` the draft distribution the children were
        sampled from without replacement, or ``None`` for deterministic children. Returns the
        index of the accepted child, or ``None`` and the residual to draw the bonus token from.
        """
        if tokens.numel() == 0:
            return None, p
        if q is None:  # point masses: follow the child that a draw from p names, if any
            drawn = torch.multinomial(p, 1, generator=generator)
            hit = torch.nonzero(tokens == drawn).flatten()
            if hit.numel():
                return int(hit[0]), p
            return None, self.residual(p, torch.zeros_like(p).index_fill_(0, tokens, 1.0))
        # Sibling i is tried only once all before it were rejected, so its p_i and q_i are fixed
        # in advance: every acceptance probability is computed first, one uniform drawn per
        # sibling, and the first success is read back once (no host read per sibling).
        chances, residuals = [], []
        for token in tokens.unbind():  # m 0-d tensors: the children, a few
            chances.append(self.accept_probability(p[token], q[token]))
            p = self.residual(p, q)
            q = self.without(q, token)
            residuals.append(p)
        draws = torch.rand(len(chances), generator=generator, device=p.device)
        success = draws < torch.stack(chances)
        first = int(torch.where(success.any(), success.int().argmax(), -1))
        if first >= 0:
            return first, residuals[first]  # the residual is unused once a child is accepted
        return None, p

    @staticmethod
    def accept_probability(p_x: Tensor, q_x: Tensor) -> Tensor:
        """``min(1, p(x) / q(x))``; a token the draft could not draw counts as certain if p allows it."""
        return (p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)).clamp(max=1.0)

    @staticmethod
    def without(q: Tensor, token: Tensor) -> Tensor:
        """``q`` without ``token`` (a 0-d index), renormalised: what the next sibling was drawn from."""
        q = q.index_fill(0, token.reshape(1), 0.0)
        return q / q.sum().clamp_min(torch.finfo(q.dtype).tiny)

    @staticmethod
    def residual(p: Tensor, q: Tensor) -> Tensor:
        """``norm(max(p - q, 0))``: what is left of ``p`` once a draw from ``q`` was rejected.

        Its mass is the rejection probability, so it is zero only where rejection cannot
        happen; should rounding still get there, ``p`` is kept.
        """
        rest = (p - q).clamp_min(0.0)
        mass = rest.sum()
        return torch.where(mass > 0, rest / mass.clamp_min(torch.finfo(rest.dtype).tiny), p)


@hookimpl
def jetflow_verifiers() -> list[type]:
    return [Sampling]
