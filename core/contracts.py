"""The three plugin contracts: Drafter, TreePolicy, Verifier.

A drafter is an oracle of next-token distributions at tree nodes; a tree policy is a
search under a budget that asks that oracle; a verifier is the acceptance rule. Any
policy works with any drafter. Each plugin class carries its public ``name`` (the string
users type), a one-line ``description`` and a pydantic ``Params`` model that validates
its own parameters from the run config.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeGuard, runtime_checkable

import torch
from jetflow.core.tree import DraftTree
from pydantic import BaseModel, ConfigDict
from torch import Tensor

if TYPE_CHECKING:
    from jetflow.core.target import Target


class NoParams(BaseModel):
    """Parameters of a plugin that takes none; unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Plugin:
    """What every plugin class declares."""

    name: ClassVar[str]
    description: ClassVar[str]
    Params: ClassVar[type[BaseModel]] = NoParams


@dataclass(frozen=True)
class DraftContext:
    """What a drafter sees at the start of a decoding step.

    Attributes:
        tokens: ``[seq]`` every committed token; ``tokens[-1]`` is the root of the next tree
            and has not been processed by the target yet.
        features: ``[new, n_layers, hidden]`` target hidden states at the drafter's
            ``feature_layers`` for the tokens processed since the drafter was last asked (the
            whole prompt but its last token on the first step; several steps' worth after
            steps at budget 0), or ``None`` if none were asked for.
        n_processed: how many of ``tokens`` the target has processed (its KV-cache length).
        depth: the deepest this step's tree can reach (its budget, within the tree shape's
            depth), or ``None`` if unbounded: a drafter may skip the work of deeper levels.
    """

    tokens: Tensor
    features: Tensor | None
    n_processed: int
    depth: int | None = None

    def check_in_step(self, cached: int, drafter: str) -> None:
        """Fail loudly if a drafter's per-token cache (``cached`` tokens) lost step with the target."""
        if cached != self.n_processed or self.n_processed != self.tokens.shape[0] - 1:
            raise RuntimeError(
                f"{drafter} context out of step: {cached} tokens cached, the target "
                f"processed {self.n_processed} of {self.tokens.shape[0]} (was reset() called?)"
            )


@runtime_checkable
class DraftSession(Protocol):
    """Answers next-token proposals for nodes of one step's tree."""

    #: deepest depth this session can propose at, ``None`` if unbounded
    max_depth: int | None

    def children(self, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Propose up to ``k`` distinct children for each of ``nodes`` (``[f]`` indices into tree).

        Returns ``(tokens [f, k], logprobs [f, k])``, best first; a log-probability of
        ``-inf`` marks an absent proposal (its token is meaningless).
        """
        ...


@runtime_checkable
class DistributionSession(DraftSession, Protocol):
    """A session that can also give its full next-token distributions, so a policy can sample."""

    def distributions(self, tree: DraftTree, nodes: Tensor) -> Tensor:
        """``[f, vocab]`` next-token probabilities at each of ``nodes``; all zero where it has none.

        ``vocab`` is the target's full vocabulary (column = token id).
        """
        ...


@runtime_checkable
class RefinableSession(DraftSession, Protocol):
    """A session that can condition a second pass on the tree built from its first answers.

    The engine builds a tree, passes it to ``refine`` and rebuilds the tree with the same
    policy from the session returned (e.g. JetFlow's path-conditioned refresh).
    """

    def refine(self, tree: DraftTree) -> DraftSession: ...


@runtime_checkable
class DepthwiseSession(DraftSession, Protocol):
    """A session whose proposals under a node depend only on the node's depth (a parallel head's
    one distribution per depth): a policy can then grow the trees of many rows in one tensor program.
    """

    def depth_proposals(self, k: int) -> tuple[Tensor, Tensor]:
        """The ``k`` best children of a node at each depth: ``(tokens [D, k], logprobs [D, k])``,
        row ``d`` for a node at depth ``d``, best first, ``-inf`` where absent."""
        ...


@runtime_checkable
class CountedSession(DraftSession, Protocol):
    """A session that counts the drafter model forwards it ran this step (the engine records them)."""

    forwards: int


# The engine asks these of every row's session every step. A session is a DraftSession already,
# so each protocol's one addition is checked directly: ``isinstance`` against a runtime protocol
# walks all of the protocol's members on every call, a sizeable share of a batched step.


def is_refinable(session: DraftSession) -> TypeGuard[RefinableSession]:
    """``isinstance(session, RefinableSession)`` for a session."""
    return callable(getattr(session, "refine", None))


def is_depthwise(session: DraftSession) -> TypeGuard[DepthwiseSession]:
    """``isinstance(session, DepthwiseSession)`` for a session."""
    return callable(getattr(session, "depth_proposals", None))


def forwards_of(session: DraftSession) -> int:
    """The drafter forwards a session counted (:class:`CountedSession`), 0 if it counts none."""
    return int(getattr(session, "forwards", 0))


class Drafter(Plugin, ABC):
    """Proposes draft tokens; built once per engine, ``begin`` once per decoding step."""

    #: tree policy used when the config names none
    default_tree_policy: ClassVar[str] = "best-first"

    def __init__(self, params: BaseModel, target: Target) -> None:
        self.params = params
        self.target = target

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers (1-based decoder-layer outputs) whose hidden states this drafter reads."""
        return ()

    @classmethod
    def available_for(cls, target: Target) -> bool:
        """Whether the drafter can run on ``target`` with default parameters (e.g. a head is shipped)."""
        return True

    @property
    def weights_digest(self) -> str | None:
        """A digest of the learned weights the drafter runs, None without any: the calibration's
        acceptance curve belongs to these weights, not to the drafter's name and parameters."""
        return None

    def reset(self) -> None:
        """Forget per-sequence state; called before each new prompt."""

    def for_row(self) -> Drafter:
        """A drafter for one more sequence of a batch: this one's weights, its own fresh state.

        A shallow copy, then :meth:`reset`: right for a drafter whose per-sequence state is
        (re)assigned by ``reset``. One that holds other mutable per-sequence objects (or
        sub-drafters) overrides this to give the row its own.
        """
        row = copy.copy(self)
        row._committed = None
        row.reset()
        return row

    def begin_rows(self, rows: Sequence[Drafter], contexts: Sequence[DraftContext]) -> list[DraftSession]:
        """Start one decoding step for several sequences at once (``rows`` made by :meth:`for_row`).

        By default each row begins alone; a drafter with a model overrides this to answer every
        row in one batched forward. Sessions come back in the order of ``rows``.
        """
        return [row.begin(context) for row, context in zip(rows, contexts, strict=True)]

    def prepare(self, depths: Sequence[int]) -> None:
        """Get ready, before any step is timed, to draft trees as deep as each of ``depths`` (the
        depth bounds of the steps to come): load or build what those steps will need, so that no
        step pays for it. Nothing by default."""

    # The target features of committed tokens, kept until the next ``begin`` asks: after steps
    # at budget 0 (nothing drafted) they pile up, and the next context carries them all. A list,
    # joined once when asked: a run of such steps then costs no copy per step.
    _committed: list[Tensor] | None = None

    def prefill(self, features: Tensor | None) -> None:
        """A new sequence: the features of the prompt the target prefilled (all but its last token)."""
        self._committed = None if features is None else [features]

    def commit(self, features: Tensor | None, path: Tensor) -> None:
        """Mirror of :meth:`Target.commit`: keep the features of the accepted ``path`` of a verify."""
        if features is None:
            return
        if self._committed is None:
            self._committed = []
        self._committed.append(features[path])

    def context(self, tokens: Tensor, n_processed: int, depth: int | None = None) -> DraftContext:
        """This step's context: the features committed since the last call (then forgotten)."""
        pending, self._committed = self._committed, None
        features = None
        if pending:  # one piece (the usual step) is handed on as it is, without a copy
            features = pending[0] if len(pending) == 1 else torch.cat(pending)
        return DraftContext(tokens, features, n_processed, depth)

    @abstractmethod
    def begin(self, context: DraftContext) -> DraftSession:
        """Start a decoding step: run any per-step model work and return a session."""


@dataclass(frozen=True)
class TreeShape:
    """The size limits a policy builds within."""

    budget: int  # drafted nodes, root excluded
    width: int  # children proposed per expanded node
    max_depth: int  # deepest level


class TreePolicy(Plugin, ABC):
    """Builds a draft tree by asking a session for children under a budget."""

    #: True if the tree of budget ``b`` is always the ``b`` best-scored nodes of the tree of any
    #: larger budget (from the same session): one verified step then shows what every smaller
    #: budget would have accepted, which the adaptive budget learns from.
    nested: ClassVar[bool] = False

    def __init__(self, params: BaseModel) -> None:
        self.params = params

    def reset(self, generator: torch.Generator) -> None:
        """Start a new sequence; a policy that samples draws from the run's seeded ``generator``."""

    @abstractmethod
    def build(self, session: DraftSession, root: DraftTree, shape: TreeShape) -> DraftTree:
        """Grow ``root`` (a one-node tree) into a tree of at most ``shape.budget`` drafted nodes."""

    @classmethod
    def build_rows(
        cls,
        policies: Sequence[TreePolicy],
        sessions: Sequence[DraftSession],
        roots: Sequence[DraftTree],
        shape: TreeShape,
    ) -> list[DraftTree]:
        """The trees of one batched step: row ``r`` grown by ``policies[r]`` (its own copy of this
        policy, with its own state) from ``sessions[r]``. Each row builds alone by default; a policy
        that can grow every row's tree in one tensor program overrides this."""
        return [
            policy.build(session, root, shape)
            for policy, session, root in zip(policies, sessions, roots, strict=True)
        ]


@dataclass(frozen=True)
class Acceptance:
    """The verifier's decision for one step.

    Attributes:
        path: ``[k + 1]`` node indices from the root to the deepest accepted node.
        next_token: the target's own token after the accepted path (the bonus token).
    """

    path: Tensor
    next_token: int

    @property
    def accepted(self) -> int:
        """Number of drafted tokens accepted (root excluded)."""
        return int(self.path.shape[0]) - 1


class Verifier(Plugin, ABC):
    """The acceptance rule: which drafted path to keep, and the next token."""

    def __init__(self, params: BaseModel) -> None:
        self.params = params

    @abstractmethod
    def accept(self, tree: DraftTree, logits: Tensor, generator: torch.Generator) -> Acceptance:
        """Decide from the target's ``logits`` (``[n, vocab]``, one row per tree node)."""
