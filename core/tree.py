"""The draft tree: one vectorised structure shared by drafters, policies and verifiers.

Nodes are stored in topological order (every parent index is smaller than its child's),
node 0 is the root: the last committed token, which the target has not processed yet.
Everything else (depths, ancestor mask, tree position ids, root-to-node paths) is
derived from ``parents`` with tensor operations, looping at most once per tree level.
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
        if self.parents[0] != -1 or bool((self.parents[1:] >= torch.arange(1, n)).any()):
            raise ValueError("parents must be topologically ordered with the root first")
        if n > 1 and bool((self.parents[1:] < 0).any()):
            raise ValueError("only the root may have no parent")
        if self.draft_probs is not None and (self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != n):
            raise ValueError("draft_probs must be [n, vocab], one row per node")

    @classmethod
    def root(cls, token: int) -> DraftTree:
        """The tree of the root alone: the autoregressive step."""
        return cls(
            tokens=torch.tensor([token], dtype=torch.long),
            parents=torch.tensor([-1], dtype=torch.long),
            scores=torch.zeros(1),
        )

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
        mask = torch.eye(n, dtype=torch.bool)
        rows = torch.arange(n)
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
        out = torch.full((n, width), -1, dtype=torch.long)
        anc_rows, anc_cols = torch.nonzero(self.ancestor_mask[:, 1:], as_tuple=True)
        anc_cols = anc_cols + 1
        out[anc_rows, self.depths[anc_cols] - 1] = self.tokens[anc_cols]
        return out

    def extend(self, parents: Tensor, tokens: Tensor, logprobs: Tensor) -> DraftTree:
        """Append children ``tokens`` under existing nodes ``parents`` (all ``[m]``).

        New nodes get all-zero ``draft_probs`` rows (nothing sampled under them yet).
        """
        draft_probs = self.draft_probs
        if draft_probs is not None:
            draft_probs = torch.cat(
                [draft_probs, draft_probs.new_zeros(tokens.shape[0], draft_probs.shape[1])]
            )
        return DraftTree(
            tokens=torch.cat([self.tokens, tokens.to(torch.long)]),
            parents=torch.cat([self.parents, parents.to(torch.long)]),
            scores=torch.cat([self.scores, self.scores[parents] + logprobs.to(self.scores.dtype)]),
            draft_probs=draft_probs,
        )

    def with_draft_probs(self, nodes: Tensor, probs: Tensor) -> DraftTree:
        """Record that the children of ``nodes`` (``[f]``) are sampled from ``probs`` (``[f, vocab]``)."""
        draft_probs = self.draft_probs
        if draft_probs is None:
            draft_probs = probs.new_zeros(self.size, probs.shape[1])
        draft_probs = draft_probs.index_copy(0, nodes.to(torch.long), probs.to(draft_probs.dtype))
        return DraftTree(
            tokens=self.tokens, parents=self.parents, scores=self.scores, draft_probs=draft_probs
        )

    def select(self, keep: Tensor) -> DraftTree:
        """The sub-tree of the nodes in ``keep`` (``[n]`` bool), which must contain its ancestors.

        Kept nodes stay in their relative (topological) order; parent indices are remapped.
        On a sampled tree, dropping some of a node's children keeps the rest a valid sample
        only if it drops a suffix in node order chosen without looking at their tokens.
        """
        keep = keep.clone()
        keep[0] = True
        if bool((self.ancestor_mask & ~keep[None, :])[keep].any()):
            raise ValueError("a kept node's ancestor was dropped")
        new_index = torch.cumsum(keep, dim=0) - 1
        old_parents = self.parents[keep]
        parents = torch.where(old_parents >= 0, new_index[old_parents.clamp(min=0)], old_parents)
        draft_probs = None if self.draft_probs is None else self.draft_probs[keep]
        return DraftTree(
            tokens=self.tokens[keep], parents=parents, scores=self.scores[keep], draft_probs=draft_probs
        )
