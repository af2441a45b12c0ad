"""The draft tree: one vectorised structure shared by drafters, policies and verifiers.

Nodes are stored in topological order (every parent index is smaller than its child's),
node 0 is the root: the last committed token, which the target has not processed yet.
Everything else (depths, ancestor mask, tree position ids, root-to-node paths) is
derived from ``parents`` with tensor operations. A tree built by :meth:`DraftTree.extend`
(as every policy grows one, level by level) carries its mask and depths forward: the new
rows are gathers of their parents' rows, so no step rebuilds or re-validates the whole tree.
All tensors of a tree live on one device, the device of its ``tokens`` (the target's).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A token tree to verify in one target forward.

    Attributes:
        tokens: ``[n]`` token id of each node; ``tokens[0]`` is the root.
        parents: ``[n]`` parent index of each node, ``-1`` for the root, ``parents[i] < i``.
        scores: ``[n]`` cumulative draft log-probability of the path to each node (root 0).
        draft_probs: ``[n, vocab]`` the draft distribution each node's children were *sampled*
            from (without replacement, in node order), an all-zero row where they were not
            sampled; ``None`` for a tree of deterministic proposals (top-k). The sampling
            verifier needs it to accept sampled children with probability ``min(1, p/q)``.
    """

    tokens: Tensor
    parents: Tensor
    scores: Tensor
    draft_probs: Tensor | None = None

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if n < 1 or self.parents.shape != (n,) or self.scores.shape != (n,):
            raise ValueError("tokens, parents and scores must be 1-D of the same length >= 1")
        if self.parents[0] != -1 or bool(
            (self.parents[1:] >= torch.arange(1, n, device=self.parents.device)).any()
        ):
            raise ValueError("parents must be topologically ordered with the root first")
        if n > 1 and bool((self.parents[1:] < 0).any()):
            raise ValueError("only the root may have no parent")
        if self.draft_probs is not None and (self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != n):
            raise ValueError("draft_probs must be [n, vocab], one row per node")

    @classmethod
    def root(cls, token: int | Tensor, device: torch.device | str | None = None) -> DraftTree:
        """The tree of the root alone: the autoregressive step.

        ``token`` may be a 0-d tensor (no host round trip); the tree lives on ``device``,
        by default the token tensor's device (the CPU for an ``int``).
        """
        if isinstance(token, Tensor):
            device = device or token.device
            tokens = token.reshape(1).to(device=device, dtype=torch.long)
        else:
            tokens = torch.tensor([token], dtype=torch.long, device=device)
        return cls.derived(
            tokens=tokens,
            parents=torch.full((1,), -1, dtype=torch.long, device=tokens.device),
            scores=torch.zeros(1, device=tokens.device),
            draft_probs=None,
            mask=torch.ones(1, 1, dtype=torch.bool, device=tokens.device),
            depths=torch.zeros(1, dtype=torch.long, device=tokens.device),
        )

    @classmethod
    def derived(
        cls,
        tokens: Tensor,
        parents: Tensor,
        scores: Tensor,
        draft_probs: Tensor | None,
        mask: Tensor | None,
        depths: Tensor | None,
    ) -> DraftTree:
        """A tree from parts already known to be consistent, its mask and depths given (not checked)."""
        tree = object.__new__(cls)
        for name, value in (("tokens", tokens), ("parents", parents), ("scores", scores)):
            object.__setattr__(tree, name, value)
        object.__setattr__(tree, "draft_probs", draft_probs)
        if mask is not None:
            tree.__dict__["ancestor_mask"] = mask  # seeds the cached properties
        if depths is not None:
            tree.__dict__["depths"] = depths
        return tree

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def size(self) -> int:
        """Number of nodes, root included (the verify forward's length)."""
        return int(self.tokens.shape[0])

    @property
    def draft_size(self) -> int:
        """Number of drafted nodes (the budget used)."""
        return self.size - 1

    @cached_property
    def ancestor_mask(self) -> Tensor:
        """``[n, n]`` bool: ``mask[i, j]`` is true when node j is node i or one of its ancestors."""
        n = self.size
        mask = torch.eye(n, dtype=torch.bool, device=self.device)
        rows = torch.arange(n, device=self.device)
        cursor = self.parents.clone()
        while bool((cursor >= 0).any()):
            live = cursor >= 0
            mask[rows[live], cursor[live]] = True
            cursor = torch.where(live, self.parents[cursor.clamp(min=0)], cursor)
        return mask

    @cached_property
    def depths(self) -> Tensor:
        """``[n]`` depth of each node; the root has depth 0."""
        return self.ancestor_mask.sum(dim=1) - 1

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def path(self, node: int) -> Tensor:
        """Node indices from the root to ``node``, inclusive, ordered by depth."""
        return torch.nonzero(self.ancestor_mask[node]).flatten()

    @cached_property
    def path_tokens(self) -> Tensor:
        """``[n, max_depth]`` drafted tokens on the path to each node (root excluded), ``-1`` padded.

        Column d holds the token at depth d + 1, so a node's own token sits in column depth - 1.
        """
        n, width = self.size, max(self.max_depth, 1)
        out = torch.full((n, width), -1, dtype=torch.long, device=self.device)
        anc_rows, anc_cols = torch.nonzero(self.ancestor_mask[:, 1:], as_tuple=True)
        anc_cols = anc_cols + 1
        out[anc_rows, self.depths[anc_cols] - 1] = self.tokens[anc_cols]
        return out

    def extend(self, parents: Tensor, tokens: Tensor, logprobs: Tensor) -> DraftTree:
        """Append children ``tokens`` under existing nodes ``parents`` (all ``[m]``).

        The new nodes' ancestor rows are their parents' rows plus themselves, and their
        depths their parents' plus one, so extending costs ``O(m * n)`` and no re-validation
        (new parents are existing nodes by construction; an index past the tree raises).
        New nodes get all-zero ``draft_probs`` rows (nothing sampled under them yet).
        """
        device = self.device
        parents = parents.to(device=device, dtype=torch.long)
        n, m = self.size, int(parents.shape[0])
        mask = self.ancestor_mask.new_zeros(n + m, n + m)
        mask[:n, :n] = self.ancestor_mask
        mask[n:, :n] = self.ancestor_mask[parents]
        mask[n:, n:] = torch.eye(m, dtype=torch.bool, device=device)
        draft_probs = self.draft_probs
        if draft_probs is not None:
            draft_probs = torch.cat([draft_probs, draft_probs.new_zeros(m, draft_probs.shape[1])])
        return DraftTree.derived(
            tokens=torch.cat([self.tokens, tokens.to(device=device, dtype=torch.long)]),
            parents=torch.cat([self.parents, parents]),
            scores=torch.cat([self.scores, self.scores[parents] + logprobs.to(device, self.scores.dtype)]),
            draft_probs=draft_probs,
            mask=mask,
            depths=torch.cat([self.depths, self.depths[parents] + 1]),
        )

    def with_draft_probs(self, nodes: Tensor, probs: Tensor) -> DraftTree:
        """Record that the children of ``nodes`` (``[f]``) are sampled from ``probs`` (``[f, vocab]``)."""
        draft_probs = self.draft_probs
        if draft_probs is None:
            draft_probs = probs.new_zeros(self.size, probs.shape[1], device=self.device)
        draft_probs = draft_probs.index_copy(
            0, nodes.to(self.device, torch.long), probs.to(draft_probs.device, draft_probs.dtype)
        )
        return DraftTree.derived(
            self.tokens, self.parents, self.scores, draft_probs, self.ancestor_mask, self.depths
        )

    def select(self, keep: Tensor) -> DraftTree:
        """The sub-tree of the nodes in ``keep`` (``[n]`` bool), which must contain its ancestors.

        Kept nodes stay in their relative (topological) order; parent indices are remapped.
        On a sampled tree, dropping some of a node's children keeps the rest a valid sample
        only if it drops a suffix in node order chosen without looking at their tokens.
        """
        keep = keep.to(self.device).clone()
        keep[0] = True
        if bool((self.ancestor_mask & ~keep[None, :])[keep].any()):
            raise ValueError("a kept node's ancestor was dropped")
        new_index = torch.cumsum(keep, dim=0) - 1
        old_parents = self.parents[keep]
        parents = torch.where(old_parents >= 0, new_index[old_parents.clamp(min=0)], old_parents)
        draft_probs = None if self.draft_probs is None else self.draft_probs[keep]
        return DraftTree.derived(
            tokens=self.tokens[keep],
            parents=parents,
            scores=self.scores[keep],
            draft_probs=draft_probs,
            mask=self.ancestor_mask[keep][:, keep],  # a kept node's ancestors are all kept
            depths=self.depths[keep],
        )
