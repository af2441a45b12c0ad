"""``greedy``: accept drafted tokens that equal the target's argmax (lossless for greedy decoding)."""

from __future__ import annotations

import torch
from jetflow.core.contracts import Acceptance, Verifier
from jetflow.core.hookspecs import hookimpl
from jetflow.core.tree import DraftTree
from torch import Tensor


class Greedy(Verifier):
    name = "greedy"
    description = "exact match with the target's argmax; output equals plain greedy decoding"

    def accept(self, tree: DraftTree, logits: Tensor, generator: torch.Generator) -> Acceptance:
        target_tokens = logits.argmax(dim=-1).to(tree.device)  # [n]; no copy when both share a device
        matches = tree.tokens == target_tokens[tree.parents.clamp(min=0)]
        matches[0] = True
        # A node is accepted when it and all its ancestors match.
        accepted = ~(tree.ancestor_mask & ~matches[None, :]).any(dim=1)
        # Siblings carry distinct tokens, so at most one node per depth is accepted.
        deepest = torch.where(accepted, tree.depths, -1).argmax()
        path = torch.nonzero(tree.ancestor_mask[deepest]).flatten()  # ordered by depth
        return Acceptance(path=path, next_token=int(target_tokens[deepest]))  # a host read per step


@hookimpl
def jetflow_verifiers() -> list[type]:
    return [Greedy]
