"""Random draft trees for the kernel tests (hypothesis strategies and fixed shapes)."""

from __future__ import annotations

import torch
from hypothesis import Phase
from hypothesis import strategies as st
from jetflow.core.tree import DraftTree

#: shrinking a failure re-runs the interpreted kernel hundreds of times (many minutes), so the
#: kernel's property tests report the first failing example as found
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)


def tree_of(parents: list[int]) -> DraftTree:
    n = len(parents)
    return DraftTree(tokens=torch.arange(n) + 2, parents=torch.tensor(parents), scores=torch.zeros(n))


def chain(n: int) -> DraftTree:
    return tree_of(list(range(-1, n - 1)))


@st.composite
def parent_lists(draw, max_nodes: int = 40) -> list[int]:
    """Topologically ordered parent lists: wide, deep and mixed trees, 1 to ``max_nodes`` nodes."""
    n = draw(st.integers(1, max_nodes))
    shape = draw(st.sampled_from(["random", "chain", "star", "recent"]))
    if shape == "chain":
        return list(range(-1, n - 1))
    if shape == "star":
        return [-1] + [0] * (n - 1)
    if shape == "recent":  # parents among the last few nodes: deep, bushy trees
        return [-1] + [draw(st.integers(max(0, i - 3), i - 1)) for i in range(1, n)]
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
