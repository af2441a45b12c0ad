"""``dflash``: the block head with a bidirectional in-block mask (DFlash-style block diffusion).

The same :class:`~jetflow.drafters.block_head.BlockHead` as ``jetflow``; the only difference
is the in-block attention mask (every slot sees every other slot of its block), so the one
forward still yields one distribution per depth, but no depth is conditioned on the
drafts before it. DFlash as published verifies a chain (``--tree-policy chain``, the
default); with ``best-first`` it is the paper's "DDTree" baseline. Its recipe
(``train.toml`` beside this module) extends jetflow's, whose loss is DFlash's: cross-entropy on
the target's tokens with per-depth decay weights.
"""

from __future__ import annotations

from jetflow.core.hookspecs import hookimpl
from jetflow.drafters.jetflow.plugin import JetFlowDrafter


class DFlashDrafter(JetFlowDrafter):
    name = "dflash"
    description = "bidirectional block head (DFlash): one forward drafts a block; chain by default"
    default_tree_policy = "chain"
    causal = False


@hookimpl
def jetflow_drafters() -> list[type]:
    return [DFlashDrafter]
