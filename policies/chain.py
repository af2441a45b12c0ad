"""``chain``: a single path, each step the drafter's top proposal (DFlash as published)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from jetflow.core.contracts import DepthwiseSession, DraftSession, TreePolicy, TreeShape
from jetflow.core.hookspecs import hookimpl
from jetflow.core.tree import DraftTree
from jetflow.policies.levelwise import grow_depthwise_rows, grow_levelwise


class Chain(TreePolicy):
    name = "chain"
    description = "one path of the drafter's top-1 proposals, as long as the budget allows"
    nested = True  # a shorter chain is the start of a longer one

    def build(self, session: DraftSession, root: DraftTree, shape: TreeShape) -> DraftTree:
        return grow_levelwise(session, root, _chain_shape(shape), frontier=1)

    @classmethod
    def build_rows(
        cls,
        policies: Sequence[TreePolicy],
        sessions: Sequence[DraftSession],
        roots: Sequence[DraftTree],
        shape: TreeShape,
    ) -> list[DraftTree]:
        """All rows' chains in one tensor program where every session proposes per depth."""
        depthwise = [session for session in sessions if isinstance(session, DepthwiseSession)]
        if len(depthwise) < len(sessions):
            return super().build_rows(policies, sessions, roots, shape)
        return grow_depthwise_rows(depthwise, roots, _chain_shape(shape), frontier=1)


def _chain_shape(shape: TreeShape) -> TreeShape:
    """One child per node, never deeper than the budget."""
    return replace(shape, width=1, max_depth=min(shape.max_depth, shape.budget))


@hookimpl
def jetflow_tree_policies() -> list[type]:
    return [Chain]
