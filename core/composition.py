"""Two drafters as one: ``--drafter jetflow+ngram`` drafts one tree from both proposals.

A drafter is an oracle of next-token proposals at tree nodes, so two compose without any
policy or verifier knowing: the composed session asks both for children of the same
nodes and answers with the best ``k`` of the union, scored as one mixture distribution

    q(x | node) = (1 - w) * p_first(x | node) + w * p_second(x | node),

where ``w`` is the second drafter's weight at nodes where it proposes anything (``0``
elsewhere, so a learned head keeps its own scale where prompt lookup has no match). A
token proposed by both gets both shares. Each score is still a log-probability <= 0 of
the token given its path, so cumulative scores never rise along a path: best-first and
the adaptive budget's nested property work unchanged.

What a prompt-lookup match is worth: ``ngram``'s own numbers are each match's share among
the matches (often 1: a single match), not how likely the target is to write it. Its
weight ``w`` is therefore *measured on the sequence being decoded*: at the start of every
step the composition checks, for each node of the previous tree that lay on the path the
target then wrote, whether the second drafter's top proposal there was the token the
target wrote next; ``w`` is that hit rate (under a Beta prior, ``prior`` and
``prior_strength``). A single match then scores about ``log w``: the probability that a
lookup continuation is right, on the same scale as the head's own estimate of the
target's probability. Code that copies from its prompt earns a high ``w``, chat a low
one. The estimate depends only on the tokens, never on the clock, so runs reproduce.

This module knows no particular drafter: it uses the contracts only (core imports no
drafter); the registry resolves a name ``a+b`` through :func:`compose`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from jetflow.core.contracts import DraftContext, Drafter, DraftSession, forwards_of, is_refinable
from jetflow.core.errors import ConfigError
from jetflow.core.tree import DraftTree
from pydantic import BaseModel, ConfigDict, Field, create_model
from torch import Tensor

if TYPE_CHECKING:
    from jetflow.core.target import Target

SEPARATOR = "+"


class MixtureParams(BaseModel):
    """The composition's own parameters (each part's sit under its name)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    prior: float = Field(0.5, gt=0, lt=1, description="second drafter's weight before any evidence")
    prior_strength: float = Field(4.0, gt=0, description="pseudo-observations behind the prior")


@dataclass
class _Observation:
    """What the second drafter proposed at the nodes of one ``children`` call."""

    depths: Tensor  # [f]
    paths: Tensor  # [f, w] drafted tokens to each node, -1 padded
    top: Tensor  # [f] its best proposal
    proposed: Tensor  # [f] bool: it proposed anything


class HitRate:
    """The second drafter's weight: how often its top proposal at a node on the target's
    path was the target's next token, under a Beta prior."""

    def __init__(self, prior: float, strength: float) -> None:
        self.prior, self.strength = prior, strength
        self.reset()

    def reset(self) -> None:
        self.hits, self.trials = 0.0, 0.0
        self._pending: list[_Observation] = []
        self._root_position: int | None = None

    @property
    def weight(self) -> float:
        return (self.hits + self.prior * self.strength) / (self.trials + self.strength)

    def expect(self, root_position: int) -> list[_Observation]:
        """Start recording the proposals of the step whose root sits at ``root_position``."""
        self._pending, self._root_position = [], root_position
        return self._pending

    def update(self, tokens: Tensor) -> None:
        """Score the last step's recorded proposals against the tokens committed since."""
        if self._root_position is None:
            return
        written = tokens[self._root_position + 1 :]  # what the target wrote after that root
        for seen in self._pending:
            width = seen.paths.shape[1]
            known = written.new_full((width,), -2)
            known[: min(width, written.shape[0])] = written[:width]
            unchecked = torch.arange(width, device=written.device) >= seen.depths[:, None]
            prefix = (seen.paths == known) | unchecked
            judged = seen.proposed & prefix.all(dim=1) & (seen.depths < written.shape[0])
            truth = written[seen.depths.clamp(max=max(written.shape[0] - 1, 0))]
            self.trials += float(judged.sum())
            self.hits += float((judged & (seen.top == truth)).sum())
        self._pending, self._root_position = [], None


def mix(
    first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor], weight: float, k: int
) -> tuple[Tensor, Tensor]:
    """The ``k`` best tokens of the union of two proposals ``(tokens [f, k_i], logprobs [f, k_i])``.

    Scored ``log((1 - w) p_first + w p_second)`` with ``w = weight`` on rows where the second
    proposes anything and ``0`` elsewhere; a token's probability under a proposal that does
    not list it counts as 0. Returns ``(tokens [f, k], logprobs [f, k])``, best first, each
    token once per row, ``-inf`` marking absent proposals.
    """
    (tokens_a, logp_a), (tokens_b, logp_b) = first, second
    valid_a, valid_b = torch.isfinite(logp_a), torch.isfinite(logp_b)
    w = torch.where(valid_b.any(dim=1, keepdim=True), weight, 0.0)  # [f, 1]
    candidates = torch.cat([torch.where(valid_a, tokens_a, -1), torch.where(valid_b, tokens_b, -1)], dim=1)

    def share(tokens: Tensor, logp: Tensor, valid: Tensor) -> Tensor:
        same = (candidates[:, :, None] == tokens[:, None, :]) & valid[:, None, :]  # [f, c, k_i]
        return (same * logp.clamp(min=-1e30).exp()[:, None, :]).sum(dim=2)

    prob = (1 - w) * share(tokens_a, logp_a, valid_a) + w * share(tokens_b, logp_b, valid_b)
    repeated = candidates[:, :, None] == candidates[:, None, :]
    earlier = repeated.new_ones(repeated.shape[1:]).tril(diagonal=-1)
    first_seen = ~(repeated & earlier).any(dim=2)
    logprobs = torch.where((candidates >= 0) & first_seen & (prob > 0), prob.log(), float("-inf"))
    if logprobs.shape[1] < k:
        pad = k - logprobs.shape[1]
        logprobs = torch.nn.functional.pad(logprobs, (0, pad), value=float("-inf"))
        candidates = torch.nn.functional.pad(candidates, (0, pad), value=0)
    best, order = logprobs.topk(k, dim=1)
    return candidates.gather(1, order).clamp(min=0), best


class ComposedSession:
    """Both sessions of a step, answering ``children`` with their mixture (see :func:`mix`)."""

    def __init__(self, sessions: Sequence[DraftSession], weight: float, record: list[_Observation]) -> None:
        self.sessions = list(sessions)
        self.weight = weight
        self._record = record
        bounded = [s.max_depth for s in self.sessions if s.max_depth is not None]
        self.max_depth = max(bounded) if len(bounded) == len(self.sessions) else None
        if any(is_refinable(s) for s in self.sessions):
            self.refine = self._refine  # the engine refines a session that offers it

    def _refine(self, tree: DraftTree) -> ComposedSession:
        """Both parts, each refined on ``tree`` if it can be (e.g. JetFlow's refresh).

        The tree rebuilt from the refined session is the one verified, so only its
        proposals are judged for the hit rate.
        """
        self._record.clear()
        refined = [s.refine(tree) if is_refinable(s) else s for s in self.sessions]
        return ComposedSession(refined, self.weight, self._record)

    @property
    def forwards(self) -> int:
        """Head forwards this step (the engine records it), summed over both drafters."""
        return sum(map(forwards_of, self.sessions))

    def _ask(self, session: DraftSession, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """``session``'s children of ``nodes``; nothing at nodes as deep as it reaches."""
        tokens = torch.zeros(nodes.shape[0], k, dtype=torch.long, device=nodes.device)
        logprobs = torch.full((nodes.shape[0], k), float("-inf"), device=nodes.device)
        reach = nodes.new_ones(nodes.shape[0], dtype=torch.bool)
        if session.max_depth is not None:
            reach = tree.depths[nodes] < session.max_depth
        if bool(reach.any()):
            asked, got = session.children(tree, nodes[reach], k)
            tokens[reach], logprobs[reach] = asked.to(tokens), got.to(logprobs)
        return tokens, logprobs

    def children(self, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
        first, second = (self._ask(s, tree, nodes, k) for s in self.sessions)
        proposed = torch.isfinite(second[1]).any(dim=1)
        best = second[1].argmax(dim=1, keepdim=True)
        self._record.append(
            _Observation(
                tree.depths[nodes], tree.path_tokens[nodes], second[0].gather(1, best)[:, 0], proposed
            )
        )
        return mix(first, second, self.weight, k)


class ComposedDrafter(Drafter):
    """Base of every composed drafter class; :func:`compose` makes one per pair of parts."""

    parts: ClassVar[tuple[type[Drafter], ...]] = ()
    params: MixtureParams

    def __init__(self, params: MixtureParams, target: Target) -> None:
        super().__init__(params, target)
        self.drafters = [cls(getattr(params, _field(cls.name)), target) for cls in self.parts]
        self.layers = tuple(sorted({layer for d in self.drafters for layer in d.feature_layers}))
        self._columns = [[self.layers.index(x) for x in d.feature_layers] for d in self.drafters]
        self.hit_rate = HitRate(params.prior, params.prior_strength)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.layers

    @property
    def weights_digest(self) -> str | None:
        """The parts' digests together, None if no part has weights."""
        digests = [drafter.weights_digest for drafter in self.drafters]
        return None if digests == [None] * len(digests) else "+".join(d or "-" for d in digests)

    @classmethod
    def available_for(cls, target: Target) -> bool:
        return all(part.available_for(target) for part in cls.parts)

    def reset(self) -> None:
        for drafter in self.drafters:
            drafter.reset()
        self.hit_rate.reset()

    def prepare(self, depths: Sequence[int]) -> None:
        for drafter in self.drafters:
            drafter.prepare(depths)

    def for_row(self) -> ComposedDrafter:
        """A row of a batch: its own parts (each a row of the part here) and its own hit rate."""
        row = copy.copy(self)
        row._committed = None
        row.drafters = [drafter.for_row() for drafter in self.drafters]
        row.hit_rate = HitRate(self.params.prior, self.params.prior_strength)
        return row

    def begin(self, context: DraftContext) -> ComposedSession:
        return self._begin_rows([self], [context])[0]

    def begin_rows(self, rows: Sequence[Drafter], contexts: Sequence[DraftContext]) -> list[DraftSession]:
        """Each part begins all rows at once (one batched forward of a head), then each row composes."""
        return list(self._begin_rows(rows, contexts))

    def _begin_rows(self, rows: Sequence[Drafter], contexts: Sequence[DraftContext]) -> list[ComposedSession]:
        composed = [self._own_row(row) for row in rows]
        for row, context in zip(composed, contexts, strict=True):
            row.hit_rate.update(context.tokens)
        per_part = [
            drafter.begin_rows([row.drafters[i] for row in composed], [_part(c, columns) for c in contexts])
            for i, (drafter, columns) in enumerate(zip(self.drafters, self._columns, strict=True))
        ]
        sessions = []
        for j, (row, context) in enumerate(zip(composed, contexts, strict=True)):
            record = row.hit_rate.expect(context.tokens.shape[0] - 1)
            sessions.append(ComposedSession([part[j] for part in per_part], row.hit_rate.weight, record))
        return sessions

    def _own_row(self, row: Drafter) -> ComposedDrafter:
        """``row`` as a row of this drafter (made by :meth:`for_row`): the same parts' classes."""
        if not isinstance(row, ComposedDrafter) or row.parts != self.parts:
            raise TypeError(f"{self.name}: begin_rows takes rows made by this drafter's for_row()")
        return row


def _part(context: DraftContext, columns: list[int]) -> DraftContext:
    """A part's context: the composition's features narrowed to the part's own layers."""
    features = None
    if context.features is not None and columns:
        features = context.features[:, columns]
    return DraftContext(context.tokens, features, context.n_processed, context.depth)


def _field(name: str) -> str:
    return name.replace("-", "_")


@cache
def compose(parts: tuple[type[Drafter], ...]) -> type[Drafter]:
    """The drafter class ``a+b`` of two drafter classes (one class per pair, so names compare).

    Its parameters are :class:`MixtureParams` plus each part's own under the part's name
    (``drafter_params.jetflow.checkpoint``, ``drafter_params.ngram.max_ngram``).
    """
    names = [part.name for part in parts]
    if len(parts) != 2 or len(set(names)) != 2:
        raise ConfigError(f"a composed drafter joins two different drafters, got {SEPARATOR.join(names)!r}")
    fields: dict[str, Any] = {
        _field(part.name): (part.Params, Field(default_factory=part.Params, alias=part.name))
        for part in parts
    }
    params = create_model(f"Params_{'_'.join(map(_field, names))}", __base__=MixtureParams, **fields)
    attributes = {
        "name": SEPARATOR.join(names),
        "description": f"one tree from {names[0]} and {names[1]}: the union of their proposals, "
        "mixed with the second's measured hit rate",
        "Params": params,
        "parts": tuple(parts),
        "default_tree_policy": parts[0].default_tree_policy,
    }
    return type(f"Composed_{'_'.join(map(_field, names))}", (ComposedDrafter,), attributes)
