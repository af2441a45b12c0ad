"""``chain``: a single path, each step the drafter's top proposal (DFlash as published)."""

from __future__ import annotations

from dataclasses import replace

from jetflow.core.contracts import TreeShape
from jetflow.core.hookspecs import hookimpl
from jetflow.policies.levelwise import LevelwisePolicy


class Chain(LevelwisePolicy):
    name = "chain"
    description = "one path of the drafter's top-1 proposals, as long as the budget allows"
    nested = True  # a shorter chain is the start of a longer one

    def level_shape(self, shape: TreeShape) -> TreeShape:
        """One child per node, never deeper than the budget."""
        return replace(shape, width=1, max_depth=min(shape.max_depth, shape.budget))

    def frontier(self, shape: TreeShape) -> int:
        return 1


@hookimpl
def jetflow_tree_policies() -> list[type]:
    return [Chain]
