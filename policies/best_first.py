"""``best-first``: the tree of highest cumulative draft log-probability (JetFlow, DDTree)."""

from __future__ import annotations

from jetflow.core.contracts import TreeShape
from jetflow.core.hookspecs import hookimpl
from jetflow.policies.levelwise import LevelwisePolicy


class BestFirst(LevelwisePolicy):
    name = "best-first"
    description = "best-first search on cumulative draft log-probability under a node budget"
    nested = True  # the budget-b tree is the b best-scored nodes (see levelwise)

    def frontier(self, shape: TreeShape) -> int:
        return shape.budget


@hookimpl
def jetflow_tree_policies() -> list[type]:
    return [BestFirst]
