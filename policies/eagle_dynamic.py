"""``eagle-dynamic``: EAGLE-2's dynamic tree, level-wise top-k expansion by cumulative log-probability.

Each level expands the ``top_k`` best new nodes of the previous level (by cumulative draft
log-probability, ``tree.width`` children each) with one batched ``children`` call, i.e. one
head forward per depth for an autoregressive drafter; the ``budget`` best nodes overall are
kept. With ``top_k >= budget`` this is exactly best-first search.
"""

from __future__ import annotations

from jetflow.core.contracts import TreeShape
from jetflow.core.hookspecs import hookimpl
from jetflow.policies.levelwise import LevelwisePolicy
from pydantic import BaseModel, ConfigDict, Field


class EagleDynamicParams(BaseModel):
    """Parameters of the ``eagle-dynamic`` policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    top_k: int = Field(10, ge=1, description="nodes expanded per level (EAGLE-2's released default: 10)")


class EagleDynamic(LevelwisePolicy):
    name = "eagle-dynamic"
    description = "EAGLE-2 dynamic tree: expand the top-k nodes of each level, keep the best budget nodes"
    Params = EagleDynamicParams
    params: EagleDynamicParams

    def frontier(self, shape: TreeShape) -> int:
        return self.params.top_k


@hookimpl
def jetflow_tree_policies() -> list[type]:
    return [EagleDynamic]
