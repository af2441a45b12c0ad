"""The block head's drafting step compiled ahead of time, wherever the target's verify is.

Eagerly, one drafting step of the block head (fusing the new tokens' features, one decoder layer
over them and over the block, the LM head over the draft vocabulary) is a few dozen small
operators on a few rows: on a CPU the per-operator dispatch and the library kernels' handling of
a few rows cost about as much again as streaming the head's weights. Once the target verifies
through packages compiled ahead of time (:mod:`jetflow.core.compiled`), that overhead is a third
of a step. So the step is compiled the same way, into one package per number of draft depths (a
causal head computes only the depths a tree can reach), with the count of new context entries and
the context's length symbolic: one package serves every step of every generation. A package is
built on first use where the target's may be (``--compile``, or ``jetflow calibrate --compile``),
kept beside the target's under the head's weights digest, and loaded by later processes; where
none is built the step runs eagerly.

The compiled kernels round differently from the eager ones, so a near-tie between two drafts may
fall the other way; verification keeps the output the target's own either way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jetflow.core.compiled import CompiledForward, build_package, load_package
from jetflow.drafters.block_head import ContextCache
from torch import Tensor, nn

if TYPE_CHECKING:
    from jetflow.drafters.jetflow.plugin import JetFlowDrafter


#: the most new context entries one compiled step takes in; a longer stretch (the prompt, on the
#: first step) is projected by the eager head, whose kernels suit many rows
MAX_NEW_ENTRIES = 64
#: the upper bound of the symbolic context length (no context is this long)
_LONGEST = 1 << 24
#: the context length and new entries of the example a package is exported with
_EXAMPLE_CONTEXT, _EXAMPLE_NEW = 8, 2
_PACKAGE_FILE = "step.pt2"
#: what changes in the exported step's signature bump, so that older packages are not loaded
STEP_FORMAT = 2


class _ExportedStep(nn.Module):
    """The step a package holds: ``(features [S, k, H], next_embeds [S, H], keys, values)`` -> the
    per-depth log-probabilities ``[D, N]`` and the extended context (each layer's keys and values
    ``[1, kv_heads, c + S, head_dim]``, the last fused feature ``[H]``).

    ``next_embeds`` embed the token after each new entry, the last of them the anchor's; ``keys`` /
    ``values`` are the context cache so far, one per head layer. The embedding lookup stays outside:
    the target's embedding table would otherwise be frozen into every package.
    """

    def __init__(self, drafter: JetFlowDrafter, depth: int) -> None:
        super().__init__()
        self.head = drafter.head
        self.logprobs = drafter.logprobs_of
        self.depth = depth

    def forward(
        self, features: Tensor, next_embeds: Tensor, keys: list[Tensor], values: list[Tensor]
    ) -> tuple[Tensor, list[Tensor], list[Tensor], Tensor | None]:
        cache = ContextCache(tuple(zip(keys, values, strict=True)))
        following = next_embeds if self.head.token_proj is not None else None
        (extended,) = self.head.extend_rows([cache], [features], [following])
        hidden = self.head.draft_rows([extended], next_embeds[-1:], self.depth)
        return (
            self.logprobs(hidden[0]),
            [layer_keys for layer_keys, _ in extended.kv],
            [layer_values for _, layer_values in extended.kv],
            extended.last_fused,
        )


class CompiledBlockStep:
    """A block head's drafting step through packages compiled beside the target's ``forward``.

    Builds a missing package only where ``forward`` builds its own (``forward.build``), with the
    same autotuning; otherwise a step without a package runs eagerly (:meth:`__call__` says so).
    """

    def __init__(self, drafter: JetFlowDrafter, forward: CompiledForward) -> None:
        self.drafter = drafter
        self.forward = forward
        #: this head's packages: under the target's, named by the head's weights
        self.folder = forward.folder / f"{drafter.name}-{drafter.weights_digest}-v{STEP_FORMAT}"
        #: seconds the first step of each depth count took: building its package, or loading it
        self.compile_s: dict[int, float] = {}
        self._runners: dict[int, Callable[..., Any] | None] = {}

    def package(self, depths: int) -> Path:
        """The package of the step that drafts ``depths`` depths."""
        return self.folder / f"depths-{depths}" / _PACKAGE_FILE

    def depths(self, bound: int | None) -> int:
        """Depths a step computes for trees no deeper than ``bound`` (None: unbounded)."""
        return self.drafter.head.drafted_depths(bound)

    @torch.inference_mode()
    def __call__(
        self, cache: ContextCache, features: Tensor | None, tokens: Tensor, bound: int | None
    ) -> tuple[ContextCache, Tensor] | None:
        """``cache`` extended by the ``features [S, k, H]`` of the newest tokens (``tokens`` ends with
        them and the anchor) and the ``[D, N]`` per-depth log-probabilities of the step after the
        anchor; None where this step runs eagerly (no package, an empty context, or no or too many
        new entries)."""
        if features is None or not 1 <= features.shape[0] <= MAX_NEW_ENTRIES or cache.length == 0:
            return None
        new = int(features.shape[0])
        runner = self.load(self.depths(bound))
        if runner is None:
            return None
        head = self.drafter.head
        following = self.drafter.shared.embed(tokens[len(tokens) - new :].to(head.device))
        logprobs, keys, values, last = runner(
            features.to(device=head.device, dtype=head.dtype),
            following.to(head.dtype),
            [layer_keys for layer_keys, _ in cache.kv],
            [layer_values for _, layer_values in cache.kv],
        )
        return ContextCache(tuple(zip(keys, values, strict=True)), last), logprobs

    def load(self, depths: int) -> Callable[..., Any] | None:
        """The step of ``depths`` depths: loaded, or built first where building is on (None: neither)."""
        if depths not in self._runners:
            package = self.package(depths)
            if not self.forward.build and not package.is_file():
                self._runners[depths] = None
                return None
            what = f"the {self.drafter.name} head for {depths}-depth drafts"
            self._runners[depths], self.compile_s[depths], _ = load_package(
                package, lambda: self._build(depths), what
            )
        return self._runners[depths]

    def _build(self, depths: int) -> None:
        head = self.drafter.head
        config = head.config
        device, dtype = head.device, head.dtype
        context = torch.zeros(
            1, config.num_kv_heads, _EXAMPLE_CONTEXT, config.head_dim, device=device, dtype=dtype
        )
        example = (
            torch.zeros(
                _EXAMPLE_NEW, len(config.feature_layers), config.hidden_size, device=device, dtype=dtype
            ),
            torch.zeros(_EXAMPLE_NEW, config.hidden_size, device=device, dtype=dtype),
            [context.clone() for _ in head.decoder_layers],
            [context.clone() for _ in head.decoder_layers],
        )
        new = torch.export.Dim("new", min=1, max=MAX_NEW_ENTRIES)
        length = {2: torch.export.Dim("context", min=1, max=_LONGEST)}
        layers = len(head.decoder_layers)
        shapes: tuple[object, ...] = ({0: new}, {0: new}, [length] * layers, [length] * layers)
        build_package(
            _ExportedStep(self.drafter, depths), example, shapes, self.package(depths), self.forward.autotune
        )
