"""``best-first``: the tree of highest cumulative draft log-probability (JetFlow, DDTree)."""

from __future__ import annotations

from collections.abc import Sequence

from jetflow.core.contracts import DepthwiseSession, DraftSession, TreePolicy, TreeShape
from jetflow.core.hookspecs import hookimpl
from jetflow.core.tree import DraftTree
from jetflow.policies.levelwise import grow_depthwise_rows, grow_levelwise


class BestFirst(TreePolicy):
    name = "best-first"
    description = "best-first search on cumulative draft log-probability under a node budget"
    nested = True  # the budget-b tree is the b best-scored nodes (see levelwise)

    def build(self, session: DraftSession, root: DraftTree, shape: TreeShape) -> DraftTree:
        return grow_levelwise(session, root, shape, frontier=shape.budget)

    @classmethod
    def build_rows(
        cls,
        policies: Sequence[TreePolicy],
        sessions: Sequence[DraftSession],
        roots: Sequence[DraftTree],
        shape: TreeShape,
    ) -> list[DraftTree]:
        """All rows' trees in one tensor program where every session proposes per depth (the
        policy holds no per-row state, so ``policies`` only say how many rows there are)."""
        depthwise = [session for session in sessions if isinstance(session, DepthwiseSession)]
        if len(depthwise) < len(sessions):
            return super().build_rows(policies, sessions, roots, shape)
        return grow_depthwise_rows(depthwise, roots, shape, frontier=shape.budget)


@hookimpl
def jetflow_tree_policies() -> list[type]:
    return [BestFirst]
