"""A test drafter that knows the reference continuation and mixes it with random wrong tokens.

It is a real Drafter plugin (registered through the same hook as any other) whose
proposals contain the true greedy token at a random rank, or not at all, so that trees
of every shape get partially accepted and the engine's accept/commit/emit logic is
exercised on deep, branching paths.
"""

from __future__ import annotations

import torch
from jetflow.core.contracts import DraftContext, Drafter
from jetflow.core.hookspecs import hookimpl
from jetflow.core.tree import DraftTree
from pydantic import BaseModel, ConfigDict
from torch import Tensor


class OracleParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    reference: tuple[int, ...] = ()  # prompt + greedy continuation
    #: several sequences' references (a batch): each step drafts from the one its tokens follow
    references: tuple[tuple[int, ...], ...] = ()
    hit_rate: float = 0.8
    vocab_size: int = 256
    seed: int = 0
    max_depth: int | None = None


class OracleSession:
    def __init__(
        self, params: OracleParams, reference: tuple[int, ...], committed: int, generator: torch.Generator
    ) -> None:
        self.params, self.reference, self.committed, self.generator = params, reference, committed, generator
        self.max_depth = params.max_depth

    def _next_reference(self, tree: DraftTree, node: int) -> int | None:
        """The reference token after ``node`` if the path to it follows the reference, else None."""
        reference = self.reference
        depth, start = int(tree.depths[node]), self.committed
        path = tree.tokens[tree.path(node)[1:]].tolist()
        on_reference = start + depth < len(reference) and list(reference[start : start + depth]) == path
        return reference[start + depth] if on_reference else None

    def children(self, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
        tokens = torch.randint(2, self.params.vocab_size, (len(nodes), k), generator=self.generator)
        for row, node in enumerate(nodes.tolist()):
            token = self._next_reference(tree, node)
            candidates = tokens[row]
            if token is not None and torch.rand((), generator=self.generator) < self.params.hit_rate:
                rank = int(torch.randint(0, k, (), generator=self.generator))
                candidates[rank] = token
            tokens[row] = _distinct(candidates, self.params.vocab_size)
        logprobs = -torch.rand(len(nodes), k, generator=self.generator).sort(dim=1).values * 3
        return tokens, logprobs

    def distributions(self, tree: DraftTree, nodes: Tensor) -> Tensor:
        """Random ``[f, vocab]`` distributions, half their mass on the reference token where on it."""
        probs = torch.softmax(
            2 * torch.randn(len(nodes), self.params.vocab_size, generator=self.generator), 1
        )
        probs[:, :2] = 0.0  # like children(): never <pad> or <eos>
        probs /= probs.sum(dim=1, keepdim=True)
        for row, node in enumerate(nodes.tolist()):
            token = self._next_reference(tree, node)
            if token is not None:
                probs[row] *= 1 - self.params.hit_rate / 2
                probs[row, token] += self.params.hit_rate / 2
        return probs


def _distinct(tokens: Tensor, vocab: int) -> Tensor:
    """Replace repeated tokens in a row by unused ones so siblings stay distinct."""
    seen: set[int] = set()
    out = []
    spare = (t for t in range(2, vocab) if t not in set(tokens.tolist()))
    for token in tokens.tolist():
        out.append(token if token not in seen else next(spare))
        seen.add(out[-1])
    return torch.tensor(out)


class OracleDrafter(Drafter):
    name = "test-oracle"
    description = "test drafter: the reference continuation mixed with random tokens"
    Params = OracleParams

    def reset(self) -> None:
        self.generator = torch.Generator().manual_seed(self.params.seed)

    def begin(self, context: DraftContext) -> OracleSession:
        # tokens[-1] is the root: the committed text ends at len(tokens)
        tokens = tuple(context.tokens.tolist())
        reference = next(
            (ref for ref in self.params.references if ref[: len(tokens)] == tokens), self.params.reference
        )
        return OracleSession(self.params, reference, len(tokens), self.generator)


@hookimpl
def jetflow_drafters() -> list[type]:
    return [OracleDrafter]
