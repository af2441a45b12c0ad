"""``best-first``: the tree of highest cumulative draft log-probability (JetFlow, DDTree)."""

from __future__ import annotations

from jetflow.core.contracts import DraftSession, TreePolicy, TreeShape
from jetflow.core.hookspecs import hookimpl
from jetflow.core.tree import DraftTree
from jetflow.policies.levelwise import grow_levelwise


class BestFirst(TreePolicy):
    name = "best-first"
    description = "best-first search on cumulative draft log-probability under a node budget"
    nested = True  # the budget-b tree is the b best-scored nodes (see levelwise)

    def build(self, session: DraftSession, root: DraftTree, shape: TreeShape) -> DraftTree:
        return grow_levelwise(session, root, shape, frontier=shape.budget)


@hookimpl
def jetflow_tree_policies() -> list[type]:
    return [BestFirst]
