"""``chain``: a single path, each step the drafter's top proposal (DFlash as published)."""

from __future__ import annotations

from dataclasses import replace

from jetflow.core.contracts import DraftSession, TreePolicy, TreeShape
from jetflow.core.hookspecs import hookimpl
from jetflow.core.tree import DraftTree
from jetflow.policies.levelwise import grow_levelwise


class Chain(TreePolicy):
    name = "chain"
    description = "one path of the drafter's top-1 proposals, as long as the budget allows"
    nested = True  # a shorter chain is the start of a longer one

    def build(self, session: DraftSession, root: DraftTree, shape: TreeShape) -> DraftTree:
        chain_shape = replace(shape, width=1, max_depth=min(shape.max_depth, shape.budget))
        return grow_levelwise(session, root, chain_shape, frontier=1)


@hookimpl
def jetflow_tree_policies() -> list[type]:
    return [Chain]
