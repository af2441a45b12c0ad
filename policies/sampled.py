"""``sampled``: children drawn at random from the drafter's distributions, for the sampling verifier.

Level by level, each frontier node (most probable path first) gets up to ``width``
distinct children drawn without replacement from the session's next-token distribution
``q`` (sequential draws by inverse CDF, kept in sampling order), until the budget is spent. The tree records
``q`` for every expanded node, so the ``sampling`` verifier can accept a child with
probability ``min(1, p/q)``, which accepts more often than following the target's own draw.

How many children a node gets depends only on its place in the frontier and on the budget
left, never on the tokens drawn for it: that keeps them a genuine sample without
replacement, which the verifier's rule relies on (trimming by the drawn tokens' scores,
as best-first does, would bias it). Draws come from the run's seeded generator.
"""

from __future__ import annotations

import torch
from jetflow.core.contracts import DistributionSession, DraftSession, TreePolicy, TreeShape
from jetflow.core.errors import ConfigError
from jetflow.core.hookspecs import hookimpl
from jetflow.core.tree import DraftTree
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor


class SampledParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, gt=0, description="temperature applied to the drafter's distributions")


def sample_without_replacement(q: Tensor, k: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Draw ``k`` distinct tokens per row of ``q`` (``[f, V]`` probabilities), in sampling order.

    Sequential draws by inverse CDF: one float64 cumulative sum per row, then per draw one
    uniform number per row, shifted past the mass of the tokens already drawn and looked up
    by binary search, so the noise is ``k`` numbers per row rather than one per vocabulary
    entry. Returns ``(tokens [f, k], log q [f, k])``; ``-inf`` marks a draw past the support of
    ``q`` (no such child). Runs on the generator's device.
    """
    device = generator.device
    q = q.to(device)
    f, vocab = q.shape
    k = min(k, vocab)
    mass = q.double()
    upper = mass.cumsum(dim=1)  # upper[t]: the mass up to and including token t
    support = (q > 0).sum(dim=1)
    rows = torch.arange(f, device=device)
    drawn = torch.zeros(f, 0, dtype=torch.long, device=device)
    for draw in range(k):  # k is the tree width, a few: never a loop over tokens
        remaining = upper[:, -1] - mass.gather(1, drawn).sum(dim=1)
        point = torch.rand(f, generator=generator, dtype=torch.float64, device=device) * remaining
        # Map the point from the remaining mass back to the whole line: step over every drawn
        # token's interval that starts at or before it, in the order they lie on the line.
        lower = upper.gather(1, drawn) - mass.gather(1, drawn)
        order = lower.argsort(dim=1)
        for column in range(draw):
            start = lower.gather(1, order[:, column : column + 1]).squeeze(1)
            width = mass.gather(1, drawn.gather(1, order[:, column : column + 1])).squeeze(1)
            point = torch.where(point >= start, point + width, point)
        token = torch.searchsorted(upper, point[:, None], right=True).squeeze(1).clamp(max=vocab - 1)
        fresh = (mass[rows, token] > 0) & ~(drawn == token[:, None]).any(dim=1)
        if not bool(fresh.all()):  # rounding put a point on no fresh token: take the likeliest one left
            token = torch.where(fresh, token, _heaviest_left(mass, drawn))
        drawn = torch.cat([drawn, token[:, None]], dim=1)
    logq = q.gather(1, drawn).log().float()
    absent = torch.arange(k, device=device)[None, :] >= support[:, None]
    return drawn, logq.masked_fill(absent, float("-inf"))


def _heaviest_left(mass: Tensor, drawn: Tensor) -> Tensor:
    """Per row, the most probable token not drawn yet: where rounding put a point on no token."""
    return mass.scatter(1, drawn, -1.0).argmax(dim=1)


def temper(q: Tensor, temperature: float) -> Tensor:
    """``q ** (1 / temperature)``, renormalised per row; all-zero rows stay zero."""
    if temperature == 1.0:
        return q
    q = q.pow(1.0 / temperature)
    return q / q.sum(dim=1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)


class Sampled(TreePolicy):
    name = "sampled"
    description = "children sampled without replacement from the drafter's distributions (sampling verifier)"
    Params = SampledParams

    def __init__(self, params: BaseModel) -> None:
        super().__init__(params)
        self.generator = torch.Generator().manual_seed(0)

    def reset(self, generator: torch.Generator) -> None:
        self.generator = generator

    def build(self, session: DraftSession, root: DraftTree, shape: TreeShape) -> DraftTree:
        if not isinstance(session, DistributionSession):
            raise ConfigError(
                f"tree policy 'sampled' needs a drafter whose sessions give next-token distributions; "
                f"{type(session).__name__} has no distributions()"
            )
        temperature = self.params.temperature  # type: ignore[attr-defined]
        tree, frontier = root, torch.zeros(1, dtype=torch.long, device=root.device)
        sampled_nodes: list[Tensor] = []
        sampled_from: list[Tensor] = []
        max_depth = shape.max_depth if session.max_depth is None else min(shape.max_depth, session.max_depth)
        for _ in range(max_depth):
            room = shape.budget - tree.draft_size
            if room <= 0 or frontier.numel() == 0:
                break
            q = session.distributions(tree, frontier).to(self.generator.device, torch.float32)
            q = temper(q, temperature)  # [f, V]
            tokens, logq = sample_without_replacement(q, shape.width, self.generator)  # [f, k]
            # Draws past a row's support come last, so `drawn` is a prefix of each row; the
            # budget goes to frontier rows in order, never by the drawn tokens.
            drawn = torch.isfinite(logq)
            drawn &= drawn.flatten().cumsum(0).view_as(drawn) <= room
            rows, cols = drawn.nonzero(as_tuple=True)
            if rows.numel() == 0:
                break
            expanded = drawn.any(dim=1)
            sampled_nodes.append(frontier[expanded])
            sampled_from.append(q[expanded])
            start = tree.size
            tree = tree.extend(frontier[rows], tokens[rows, cols], logq[rows, cols])
            new = torch.arange(start, tree.size, device=tree.device)
            frontier = new[torch.sort(tree.scores[new], descending=True, stable=True).indices]
        if not sampled_nodes:
            return tree
        return tree.with_draft_probs(torch.cat(sampled_nodes), torch.cat(sampled_from))


@hookimpl
def jetflow_tree_policies() -> list[type]:
    return [Sampled]
