"""``ngram``: draft trees from the continuations of earlier n-gram matches in the context.

Every earlier occurrence of the context's last n tokens (longest n first, most recent
first) contributes its continuation; the continuations form a trie whose branching is
scored by match weight, so a policy can grow a tree from several matches at once.
Written against the public contracts only, exactly as a third-party drafter would be.
"""

from __future__ import annotations

import torch
from jetflow.core.contracts import DraftContext, Drafter
from jetflow.core.hookspecs import hookimpl
from jetflow.core.tree import DraftTree
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor


class NgramParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_ngram: int = Field(3, ge=1, description="longest suffix to look up")
    min_ngram: int = Field(1, ge=1, description="shortest suffix to look up")
    max_matches: int = Field(32, ge=1, description="continuations kept, most recent first")
    max_continuation: int = Field(16, ge=1, description="tokens taken after each match")

    @model_validator(mode="after")
    def _ordered(self) -> NgramParams:
        if self.min_ngram > self.max_ngram:
            raise ValueError("min_ngram must not exceed max_ngram")
        return self


class NgramSession:
    """Continuations ``[matches, depth]`` (``-1`` padded) with a weight per match."""

    def __init__(self, continuations: Tensor, weights: Tensor) -> None:
        self.continuations = continuations
        self.weights = weights
        self.max_depth = int((continuations >= 0).sum(dim=1).max()) if len(weights) else 0

    def children(self, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
        cont, width = self.continuations, self.continuations.shape[1]
        depths = tree.depths[nodes]  # [f]
        paths = tree.path_tokens[nodes]  # [f, tree depth]
        columns = torch.arange(width, device=cont.device)
        # A continuation follows a node when its first `depth` tokens equal the node's path.
        padded = torch.full((len(nodes), width), -1, dtype=torch.long, device=cont.device)
        shared = min(width, paths.shape[1])
        padded[:, :shared] = paths[:, :shared]
        on_path = columns[None, :] < depths[:, None]  # [f, width]
        agree = (cont[None, :, :] == padded[:, None, :]) | ~on_path[:, None, :]
        follows = agree.all(dim=2)  # [f, matches]
        next_tokens = cont[:, depths.clamp(max=width - 1)].T  # [f, matches]
        valid = follows & (next_tokens >= 0) & (depths < width)[:, None]
        # Weight of each distinct next token, credited to its first occurrence only.
        same = (next_tokens[:, :, None] == next_tokens[:, None, :]) & valid[:, None, :]
        votes = (same * self.weights[None, None, :]).sum(dim=2)
        earlier = torch.tril(torch.ones(same.shape[1:], dtype=torch.bool, device=cont.device), diagonal=-1)
        first = valid & ~(same & earlier[None]).any(dim=2)
        total = (valid * self.weights[None, :]).sum(dim=1, keepdim=True).clamp(min=1e-9)
        logprobs = torch.where(first, torch.log(votes / total), float("-inf"))
        if logprobs.shape[1] < k:
            pad = k - logprobs.shape[1]
            logprobs = torch.nn.functional.pad(logprobs, (0, pad), value=float("-inf"))
            next_tokens = torch.nn.functional.pad(next_tokens, (0, pad), value=0)
        best, order = logprobs.topk(k, dim=1)
        return next_tokens.gather(1, order), best


class NgramDrafter(Drafter):
    name = "ngram"
    description = "training-free prompt lookup; trees from several n-gram matches in the context"
    Params = NgramParams
    default_tree_policy = "best-first"

    def begin(self, context: DraftContext) -> NgramSession:
        params: NgramParams = self.params
        tokens = context.tokens
        starts, weights = self._match_starts(tokens, params)
        depth = params.max_continuation
        padded = torch.cat([tokens, tokens.new_full((depth,), -1)])
        continuations = padded[starts[:, None] + torch.arange(depth, device=tokens.device)[None, :]]
        return NgramSession(continuations, weights)

    @staticmethod
    def _match_starts(tokens: Tensor, params: NgramParams) -> tuple[Tensor, Tensor]:
        """Continuation start positions (longest n, then most recent first) and their weights."""
        found_starts: list[Tensor] = []
        found_n: list[Tensor] = []
        for n in range(params.max_ngram, params.min_ngram - 1, -1):
            if tokens.shape[0] <= n:
                continue
            windows = tokens[:-1].unfold(0, n, 1)  # windows ending before the last token
            hits = torch.nonzero((windows == tokens[-n:]).all(dim=1)).flatten().flip(0)
            found_starts.append(hits + n)
            found_n.append(torch.full_like(hits, n))
        if not found_starts:
            return tokens.new_zeros(0), torch.zeros(0, device=tokens.device)
        starts, lengths = torch.cat(found_starts), torch.cat(found_n)
        # A position matched by a long n-gram also matches every shorter one: keep it once.
        unique_starts, inverse = torch.unique(starts, return_inverse=True)
        first = torch.full_like(unique_starts, starts.shape[0]).scatter_reduce(
            0, inverse, torch.arange(starts.shape[0], device=starts.device), reduce="amin"
        )
        keep = torch.sort(first).values[: params.max_matches]
        return starts[keep], lengths[keep].float()


@hookimpl
def jetflow_drafters() -> list[type]:
    return [NgramDrafter]
