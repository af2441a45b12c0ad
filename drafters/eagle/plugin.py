"""``eagle``: the EAGLE-3-style autoregressive head; one head forward per tree level.

Both head layouts (``jetflow``, ``eagle3``: :mod:`jetflow.drafters.eagle.head`) draft
through this one session: each evaluated node keeps its normed output (its children's
distribution) and its state (what its children's entries read).

``begin`` appends the newly committed (feature, next token) entries to the head's own KV
cache (only they are projected) and runs the root's query: the depth-1 distribution. The
session then answers ``children`` for a frontier with one batched forward over the
frontier's not yet evaluated nodes, each attending to the cache, its drafted ancestors and
itself, so every branch is conditioned on its own path. ``forwards`` counts the head
forwards of the step (the engine records it).

Checkpoints have the shared trainer's format; the default is the head shipped for the
target under ``checkpoints/<target name>/`` beside this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from jetflow.core.contracts import DraftContext
from jetflow.core.errors import ConfigError, DataError
from jetflow.core.hookspecs import hookimpl
from jetflow.core.tree import DraftTree
from jetflow.drafters.blocks import DraftLMHead, FrozenTargetParts, full_vocabulary, top_proposals
from jetflow.drafters.eagle.head import EagleCache, EagleHead, EagleHeadConfig, append_kv
from jetflow.drafters.learned import LearnedDrafter, LearnedParams
from pydantic import Field, ValidationError
from torch import Tensor

if TYPE_CHECKING:
    from jetflow.core.target import Target


class EagleParams(LearnedParams):
    """Run-time parameters of the eagle drafter."""

    max_depth: int | None = Field(
        None, ge=1, description="deepest draft level (one head forward each); None: the trained depth"
    )


class EagleSession:
    """Children of tree nodes from the head, one batched forward per call on new nodes.

    Node states are kept by node index, so between calls the tree may only grow
    (:meth:`DraftTree.extend`), which is what level-wise policies do.

    Attributes:
        forwards: head forwards run for this step (the root's query included).
    """

    def __init__(
        self,
        head: EagleHead,
        lm: DraftLMHead,
        shared: FrozenTargetParts,
        cache: EagleCache,
        max_depth: int | None,
    ) -> None:
        self.head, self.lm, self.shared, self.cache = head, lm, shared, cache
        root = head.root_hidden(cache)
        self.max_depth: int | None = max_depth if root is not None else 0
        self.forwards = int(root is not None)
        # [m, H] each, evaluated nodes, root first: the normed outputs (logits) and the states
        # their children's entries read (the same tensor in the jetflow layout)
        self._hidden = root[0][None] if root is not None else None
        self._states = root[1][None] if root is not None else None
        empty = cache.kv[0][:, :, :0]
        self._drafted: tuple[Tensor, Tensor] = (empty, empty)  # keys/values of evaluated non-root nodes
        device = head.device  # the target's, where the tree lives
        self._nodes = torch.zeros(1, dtype=torch.long, device=device)  # tree node of each row of _hidden
        self._tokens = torch.zeros(1, dtype=torch.long, device=device)  # their tokens (root's unchecked)
        self._row = torch.zeros(1, dtype=torch.long, device=device)  # row of each node, -1 if not evaluated

    @torch.inference_mode()
    def children(self, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
        logprobs = self._logprobs(tree, nodes)
        if logprobs is None:  # no committed entry yet (a one-token prompt): nothing to draft
            none = torch.full((nodes.shape[0], k), -torch.inf, device=nodes.device)
            return torch.zeros(none.shape, dtype=torch.long, device=nodes.device), none
        return top_proposals(logprobs, k, self.lm.tokens)

    @torch.inference_mode()
    def distributions(self, tree: DraftTree, nodes: Tensor) -> Tensor:
        """``[f, vocab]`` next-token probabilities over the target's vocabulary (for sampled trees)."""
        vocab_size = int(self.shared.lm_head.weight.shape[0])
        logprobs = self._logprobs(tree, nodes)
        if logprobs is None:
            return torch.zeros(nodes.shape[0], vocab_size, device=nodes.device)
        return full_vocabulary(logprobs.exp(), self.lm.tokens, vocab_size)

    def _logprobs(self, tree: DraftTree, nodes: Tensor) -> Tensor | None:
        """``[f, N]`` float32 log-probabilities over the draft vocabulary; None before any entry."""
        if self._hidden is None:
            return None
        self._check_grown(tree)
        if self._row.shape[0] < tree.size:
            self._row = F.pad(self._row, (0, tree.size - self._row.shape[0]), value=-1)
        new = nodes[self._row[nodes] < 0].unique()
        if new.numel():
            self._evaluate(tree, new)
        hidden = self._hidden[self._row[nodes].to(self._hidden.device)]
        return torch.log_softmax(self.lm.logits(hidden).float(), dim=-1)

    def _check_grown(self, tree: DraftTree) -> None:
        """Refuse a tree whose evaluated nodes moved (a policy that pruned between calls)."""
        known = self._nodes[1:]
        if known.numel() and (
            int(known.max()) >= tree.size or not torch.equal(tree.tokens[known], self._tokens[1:])
        ):
            raise RuntimeError("the eagle session needs a tree that only grows between children calls")

    def _evaluate(self, tree: DraftTree, new: Tensor) -> None:
        """One head forward for drafted nodes ``new`` (``[q]``) whose parents were evaluated."""
        if self._hidden is None or self._states is None:
            raise RuntimeError("the eagle session has no root to draft from (an empty context)")
        parent_rows = self._row[tree.parents[new]]
        if bool((parent_rows < 0).any()):
            raise RuntimeError("children asked for a node whose parent was never expanded")
        device = self.head.device
        x = self.head.entry_inputs(
            self.shared.embed(tree.tokens[new].to(device)), self._states[parent_rows.to(device)]
        )
        positions = (self.cache.length - 1 + tree.depths[new]).to(device)
        ancestors = tree.ancestor_mask[new]
        mask = torch.cat([ancestors[:, self._nodes[1:]], ancestors[:, new]], dim=1).to(device)
        hidden, states = self.head.draft_step(self.cache, self._drafted, x, positions, mask)
        keys, values = self.head.entry_kv(x[None], positions[None])
        self._drafted = append_kv(self._drafted, (keys, values))
        self._row[new] = self._nodes.shape[0] + torch.arange(new.shape[0], device=new.device)
        self._nodes = torch.cat([self._nodes, new])
        self._tokens = torch.cat([self._tokens, tree.tokens[new]])
        self._hidden = torch.cat([self._hidden, hidden])
        self._states = torch.cat([self._states, states])
        self.forwards += 1


class EagleDrafter(LearnedDrafter[EagleCache]):
    name = "eagle"
    description = "EAGLE-3-style autoregressive head: one forward per tree level, path-conditioned"
    Params = EagleParams
    default_tree_policy = "eagle-dynamic"
    params: EagleParams
    head: EagleHead

    @classmethod
    def head_from_architecture(cls, architecture: dict[str, Any]) -> EagleHead:
        """Rebuild a head from a checkpoint's architecture record."""
        try:
            return EagleHead(EagleHeadConfig.model_validate(architecture))
        except ValidationError as error:
            raise DataError(f"unreadable {cls.name} head architecture: {error.errors()[0]['msg']}") from None

    @classmethod
    def new_head(cls, target: Target, options: dict[str, Any]) -> EagleHead:
        """A freshly initialised head for ``target``; ``options`` override the derived sizes."""
        try:
            return EagleHead(EagleHeadConfig.for_target(target, **options))
        except ValueError as error:
            raise ConfigError(f"invalid head options for {cls.name}: {error}") from None

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def begin(self, context: DraftContext) -> EagleSession:
        if context.features is not None and context.features.shape[0]:
            start = self._cache.length
            next_tokens = context.tokens[start + 1 : start + 1 + context.features.shape[0]]
            embeds = self.shared.embed(next_tokens.to(self.head.device))
            self._cache = self.head.extend(self._cache, context.features, embeds)
        context.check_in_step(self._cache.length, self.name)
        depth = self.params.max_depth or self.head.max_depth  # no deeper than trained unless asked
        return EagleSession(self.head, self.lm, self.shared, self._cache, depth)


@hookimpl
def jetflow_drafters() -> list[type]:
    return [EagleDrafter]
