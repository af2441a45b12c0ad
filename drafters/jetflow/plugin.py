"""``jetflow``: the causal parallel block head; one head forward per decoding step.

``begin`` projects the newly processed tokens' features into the head's per-layer context
cache and runs one block forward from the root; the session then answers ``children`` for
any node from the per-depth distributions (top-k of depth ``d + 1`` for a node at depth
``d``), so a policy may build a tree of any budget at no extra head cost.
``begin_rows`` does the same for every sequence of a batch in one block forward (each row
keeps its own cache; the contexts are padded to the longest for that forward).

Checkpoints are found as for every learned drafter (:mod:`jetflow.drafters.learned`). A
bidirectional variant (DFlash) is this class with ``causal = False``, another ``name`` and its
own checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from jetflow.core.contracts import DraftContext, Drafter, DraftSession
from jetflow.core.errors import CheckpointMismatchError, ConfigError, DataError
from jetflow.core.hookspecs import hookimpl
from jetflow.core.tree import DraftTree
from jetflow.drafters.block_head import (
    BlockHead,
    BlockHeadConfig,
    ContextCache,
    copy_target_layers,
    target_has_qk_norm,
)
from jetflow.drafters.blocks import full_vocabulary, top_proposals
from jetflow.drafters.compiled_step import CompiledBlockStep
from jetflow.drafters.learned import LearnedDrafter, LearnedParams
from pydantic import Field, ValidationError
from torch import Tensor

if TYPE_CHECKING:
    from jetflow.core.target import Target


class BlockHeadParams(LearnedParams):
    """Run-time parameters of a block-head drafter."""

    refresh: bool = Field(
        False,
        description="path-conditioned refresh: a second head pass over the built tree gives every "
        "node children conditioned on its own path, and the tree is rebuilt from them",
    )


class PerDepthSession:
    """Children of any node from one distribution per depth.

    Attributes:
        logprobs: ``[D, N]`` float32 log-probabilities of depths ``1 .. D`` over the draft
            vocabulary (the full vocabulary unless the head drafts over a subset).
        vocab: ``[N]`` vocabulary id of each column, or None when columns are ids.
    """

    #: head forwards per step: the one block forward ``begin`` ran (children are free)
    forwards: int = 1

    def __init__(self, logprobs: Tensor, vocab: Tensor | None = None, vocab_size: int | None = None) -> None:
        self.logprobs = logprobs
        self.vocab = vocab
        self.vocab_size = vocab_size or int(logprobs.shape[1])  # the target's full vocabulary
        self.max_depth: int | None = int(logprobs.shape[0])
        self._top: dict[int, tuple[Tensor, Tensor]] = {}

    def full_vocabulary(self, rows: Tensor) -> Tensor:
        """Probabilities over the draft vocabulary ``[f, N]`` -> over the full one ``[f, V]``."""
        return full_vocabulary(rows, self.vocab, self.vocab_size)

    def distributions(self, tree: DraftTree, nodes: Tensor) -> Tensor:
        """``[f, V]`` next-token probabilities (the next depth's row); zero below the last depth."""
        depths = tree.depths[nodes]
        rows = self.logprobs[depths.clamp(max=self.logprobs.shape[0] - 1)].exp()
        return self.full_vocabulary(rows.masked_fill((depths >= self.logprobs.shape[0])[:, None], 0.0))

    def depth_proposals(self, k: int) -> tuple[Tensor, Tensor]:
        """Top-``k`` per depth, computed once per ``k``: ``(tokens [D, k], logprobs [D, k])``."""
        if k not in self._top:
            self._top[k] = top_proposals(self.logprobs, k, self.vocab)
        return self._top[k]

    def children(self, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
        tokens, values = self.depth_proposals(k)
        depths = tree.depths[nodes]  # children sit at depth + 1, i.e. row `depth`
        rows = depths.clamp(max=values.shape[0] - 1)
        logprobs = values[rows].masked_fill((depths >= values.shape[0])[:, None], float("-inf"))
        return tokens[rows], logprobs


class RefreshableSession(PerDepthSession):
    """A per-depth session that the engine may ``refine``: the drafter's refresh pass over a tree."""

    def __init__(
        self,
        logprobs: Tensor,
        vocab: Tensor | None,
        vocab_size: int,
        refresh: Callable[[PerDepthSession, DraftTree], PathConditionedSession],
    ) -> None:
        super().__init__(logprobs, vocab, vocab_size)
        self._refresh = refresh

    def refine(self, tree: DraftTree) -> PathConditionedSession:
        return self._refresh(self, tree)


class PathConditionedSession:
    """Children conditioned on each node's actual path, from one refresh pass over a first tree.

    ``first`` is the tree the refresh pass saw and ``logprobs [n, N]`` the distribution of
    each of its nodes' children. A node of the tree being rebuilt that is also a node of
    ``first`` (same path) answers from its own row; any other node falls back to ``base``
    (the per-depth distributions), so the rebuilt tree may grow where ``first`` did not.
    """

    def __init__(self, base: PerDepthSession, first: DraftTree, logprobs: Tensor) -> None:
        self.base = base
        self.max_depth = base.max_depth
        self.forwards = base.forwards + 1  # the block forward and the refresh pass
        self.per_node = PerDepthSession(logprobs, base.vocab, base.vocab_size)  # row i: first-tree node i
        self._stride = int(
            max(logprobs.shape[1] if base.vocab is None else base.vocab.max() + 1, first.tokens.max() + 1)
        )
        keys, order = (first.parents[1:] * self._stride + first.tokens[1:]).sort()
        # A sentinel above every key keeps searchsorted in range; it never matches.
        self._keys = torch.cat([keys, keys.new_full((1,), self._stride * (first.size + 1))])
        self._children = torch.cat([order + 1, order.new_full((1,), -1)])  # first-tree node of each key
        self._match = order.new_zeros(1)  # rebuilt-tree node -> first-tree node or -1

    def _matches(self, tree: DraftTree) -> Tensor:
        """First-tree node of every node of ``tree`` (``-1`` if none), extended level by level."""
        while self._match.shape[0] < tree.size:
            known = self._match.shape[0]
            ready = tree.parents[known:] < known  # a prefix, as the tree is topologically ordered
            count = int(ready.long().cumprod(0).sum())
            parent_match = self._match[tree.parents[known : known + count]]
            keys = parent_match * self._stride + tree.tokens[known : known + count]
            slot = torch.searchsorted(self._keys, keys)
            found = (parent_match >= 0) & (self._keys[slot] == keys)
            self._match = torch.cat([self._match, torch.where(found, self._children[slot], -1)])
        return self._match

    def children(self, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
        tokens, logprobs = self.base.children(tree, nodes, k)
        first = self._matches(tree)[nodes]
        hit = first >= 0
        if bool(hit.any()):
            ids, values = self.per_node.depth_proposals(k)
            tokens[hit], logprobs[hit] = ids[first[hit]], values[first[hit]]
        return tokens, logprobs

    def distributions(self, tree: DraftTree, nodes: Tensor) -> Tensor:
        """``[f, V]``: a node's own refreshed distribution where it has one, else the depth's."""
        probs = self.base.distributions(tree, nodes)
        first = self._matches(tree)[nodes]
        hit = first >= 0
        probs[hit] = self.per_node.full_vocabulary(self.per_node.logprobs[first[hit]].exp())
        return probs


class JetFlowDrafter(LearnedDrafter[ContextCache]):
    name = "jetflow"
    description = "causal parallel block head: one forward drafts a distribution per depth"
    Params = BlockHeadParams
    default_tree_policy = "best-first"
    params: BlockHeadParams
    head: BlockHead
    #: in-block attention mask of the head this drafter trains and loads
    causal: ClassVar[bool] = True

    def __init__(self, params: BlockHeadParams, target: Target) -> None:
        super().__init__(params, target)
        if params.refresh and not self.head.config.path_conditioning:
            raise ConfigError(
                f"refresh needs a {self.name} head trained with path_conditioning > 0; "
                f"{self.checkpoint} was not"
            )
        #: the compiled drafting step, made once the target verifies compiled
        self._compiled: CompiledBlockStep | None = None

    @classmethod
    def head_from_architecture(cls, architecture: dict[str, Any]) -> BlockHead:
        """Rebuild a head from a checkpoint's architecture record."""
        try:
            config = BlockHeadConfig.model_validate(architecture)
        except ValidationError as error:
            raise DataError(f"unreadable {cls.name} head architecture: {error.errors()[0]['msg']}") from None
        if config.causal != cls.causal:
            raise CheckpointMismatchError(
                f"a {cls.name} head has causal={cls.causal}; this checkpoint has causal={config.causal}"
            )
        return BlockHead(config)

    @classmethod
    def new_head(cls, target: Target, options: dict[str, Any]) -> BlockHead:
        """A freshly initialised head for ``target``; ``options`` override the derived sizes."""
        if "causal" in options and options["causal"] != cls.causal:
            raise ConfigError(f"the {cls.name} head is causal={cls.causal}; use the other drafter")
        options = options | {"causal": cls.causal}
        if options.get("init_from_target"):  # the copied attention normalises q/k only if the target's does
            options.setdefault("qk_norm", target_has_qk_norm(target))
        try:
            config = BlockHeadConfig.for_target(target, **options)
            head = BlockHead(config)
            if config.init_from_target:
                copy_target_layers(head, target)
        except ValueError as error:
            raise ConfigError(f"invalid head options for {cls.name}: {error}") from None
        return head

    # ------------------------------------------------------------------ drafting
    def begin(self, context: DraftContext) -> PerDepthSession:
        return self._begin_rows([self], [context])[0]

    def begin_rows(self, rows: Sequence[Drafter], contexts: Sequence[DraftContext]) -> list[DraftSession]:
        """Every row's step in one head forward and one LM-head product (rows padded to the longest)."""
        return list(self._begin_rows(rows, contexts))

    @torch.inference_mode()
    def _begin_rows(self, rows: Sequence[Drafter], contexts: Sequence[DraftContext]) -> list[PerDepthSession]:
        drafters = [self._own_row(row) for row in rows]
        bounds = [context.depth for context in contexts]
        depth = None if None in bounds else max(cast("list[int]", bounds))
        if len(drafters) == 1:  # one sequence: through the compiled head where there is one
            compiled = self._compiled_begin(drafters[0], contexts[0], depth)
            if compiled is not None:
                return [compiled]
        self._take_in(drafters, contexts)
        roots = torch.stack([context.tokens[-1] for context in contexts]).to(self.head.device)
        caches = [row._cache for row in drafters]
        hidden = self.head.draft_rows(caches, self.shared.embed(roots), depth)  # [R, D, H]
        logprobs = self.logprobs_of(hidden.flatten(0, 1)).unflatten(0, hidden.shape[:2])  # [R, D, N]
        return [row._session(row_logprobs) for row, row_logprobs in zip(drafters, logprobs, strict=True)]

    def _compiled_begin(
        self, row: JetFlowDrafter, context: DraftContext, depth: int | None
    ) -> PerDepthSession | None:
        """``row``'s step through the compiled head where the target verifies compiled (None: eagerly)."""
        compiled = self._compiled_step()
        stepped = None if compiled is None else compiled(row._cache, context.features, context.tokens, depth)
        if stepped is None:
            return None
        row._cache, logprobs = stepped
        context.check_in_step(row._cache.length, self.name)
        return row._session(logprobs)

    def _compiled_step(self) -> CompiledBlockStep | None:
        """The compiled drafting step beside the target's compiled forward (None: the target is eager)."""
        forward = self.target.compiled
        if forward is None:
            return None
        if self._compiled is None or self._compiled.forward is not forward:
            self._compiled = CompiledBlockStep(self, forward)
        return self._compiled

    def prepare(self, depths: Sequence[int]) -> None:
        """Load (or, where the target's packages are built, build) the compiled steps of ``depths``."""
        compiled = self._compiled_step()
        if compiled is not None:
            for count in sorted({compiled.depths(depth) for depth in depths}):
                compiled.load(count)

    def _own_row(self, row: Drafter) -> JetFlowDrafter:
        """``row`` as a row of this drafter (made by :meth:`for_row`): same class, same head."""
        if not isinstance(row, JetFlowDrafter) or row.head is not self.head:
            raise TypeError(f"{self.name}: begin_rows takes rows made by this drafter's for_row()")
        return row

    def _take_in(self, rows: Sequence[JetFlowDrafter], contexts: Sequence[DraftContext]) -> None:
        """Project every row's newly processed tokens into its context cache (one head pass for
        all rows) and check each is in step."""
        none = torch.empty(0, len(self.feature_layers), self.head.config.hidden_size)
        features, following = [], []
        for context in contexts:
            new = none if context.features is None else context.features
            features.append(new)
            tokens = context.tokens[len(context.tokens) - new.shape[0] :]  # the token after each
            needed = self.head.token_proj is not None
            following.append(self.shared.embed(tokens.to(self.head.device)) if needed else None)
        caches = self.head.extend_rows([row._cache for row in rows], features, following)
        for row, cache, context in zip(rows, caches, contexts, strict=True):
            row._cache = cache
            context.check_in_step(cache.length, self.name)

    def _session(self, logprobs: Tensor) -> PerDepthSession:
        """This row's session over its ``[D, N]`` per-depth log-probabilities."""
        if self.params.refresh:
            return RefreshableSession(logprobs, self._vocab, self.target.vocab_size, refresh=self.refresh)
        return PerDepthSession(logprobs, self._vocab, self.target.vocab_size)

    @property
    def _vocab(self) -> Tensor | None:
        return self.lm.tokens

    def logprobs_of(self, hidden: Tensor) -> Tensor:
        """Log-probabilities over the draft vocabulary of the head's normed ``hidden [..., H]``."""
        return torch.log_softmax(self.lm.logits(hidden).float(), dim=-1)

    @torch.inference_mode()
    def refresh(self, session: PerDepthSession, tree: DraftTree) -> PathConditionedSession:
        """One more head pass over ``tree``: every node's children given its actual path."""
        embeds = self.shared.embed(tree.tokens.to(self.head.device))
        hidden = self.head.refresh(self._cache, embeds, tree.depths, tree.ancestor_mask)
        return PathConditionedSession(session, tree, self.logprobs_of(hidden))


@hookimpl
def jetflow_drafters() -> list[type]:
    return [JetFlowDrafter]
