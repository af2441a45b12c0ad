"""The target's verify forward compiled by inductor: one graph per tree-size bucket.

Eager matrix kernels handle the few rows of a small tree badly on a CPU (the weight is packed
again on every call, so a 3-node verify can cost twice a single step), and a one-token step of
a small model is dominated by per-operator framework overhead. Compiling the whole forward
with ``freezing`` folds the weights into constants that inductor packs once, fuses the
elementwise work, and (with ``autotune``) lets inductor's C++ GEMM template compete with the
library kernels for each matrix shape.

Shapes: a graph is compiled for a fixed number of rows (a *bucket*; a smaller tree is padded
with rows nobody sees and whose outputs are dropped), while the length of the KV history is
symbolic, so one graph per bucket serves every context length. The KV history is the slab of
:mod:`jetflow.core.kv_cache`: each graph writes the new rows' keys and values in place and
attends over the filled part. Graphs are compiled on first use of their bucket and kept by
inductor's on-disk caches under :func:`inductor_cache_dir`, so a second process starts warm.

Compiled kernels round differently from eager ones (and from each other across buckets), so
this path is exact per shape, not bitwise equal to ``transformers.generate``; the lossless
checks classify each divergence as a near-tie or a bug.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from jetflow.core.cache_root import cache_root
from jetflow.core.kv_cache import slab_layers
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

log = logging.getLogger(__name__)

#: row counts a graph is compiled for; a tree runs in the smallest bucket that holds it. One row
#: is a plain step; the others are the sizes of full trees of the budgets a first-use
#: calibration chooses among (a root and B nodes), so a full tree is never padded.
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 3, 5, 9, 16, 32)
#: where inductor keeps its caches (compiled graphs, autotuning results)
INDUCTOR_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
#: the upper bound of the symbolic history length (dynamo needs one; no context is this long)
_LONGEST = 1 << 24


def inductor_cache_dir() -> Path:
    """Where inductor keeps compiled graphs and autotuning results: under jetflow's cache."""
    return cache_root() / "inductor"


def _use_jetflow_caches() -> None:
    """Point inductor's on-disk caches at jetflow's cache folder unless the user chose one.

    Importing triton (the tree-attention module does) already makes torch write its default,
    a per-user folder under the temporary directory that a reboot empties, into the variable:
    that value counts as unset, so compiled graphs live with the calibrations that chose them.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get(INDUCTOR_CACHE_VARIABLE)
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ[INDUCTOR_CACHE_VARIABLE] = str(inductor_cache_dir())
    import torch._inductor.config as inductor

    inductor.fx_graph_cache = True
    inductor.autotune_local_cache = True


class _SlabWindow:
    """The cache the model sees inside a compiled graph: per layer, the slab's first ``L`` positions.

    ``L`` (the history plus this forward's rows) is the mask's last dimension; the new rows' keys
    and values are written at ``L - rows .. L`` in place. The whole slab is the graph's input
    (its capacity symbolic like ``L``): a view of it would carry the capacity in its strides,
    which dynamo guards on, and every new capacity would compile again.
    """

    is_compileable = True

    def __init__(self, keys: Sequence[Tensor], values: Sequence[Tensor], start, stop) -> None:
        self.keys, self.values, self.start, self.stop = keys, values, start, stop

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[:, :, self.start : self.stop] = key_states
        values[:, :, self.start : self.stop] = value_states
        return keys[:, :, : self.stop], values[:, :, : self.stop]

    def get_seq_length(self, layer_idx: int = 0):
        return self.start


class CompiledForward:
    """The target model's tree forward, compiled per bucket of row counts.

    Args:
        model: the frozen target model (any ``transformers`` causal LM of full-attention layers).
        buckets: row counts to compile for; trees larger than the largest run eagerly.
        autotune: let inductor benchmark its C++ GEMM template against the library kernels
            for every matrix shape (slower to compile, faster small-row products).
    """

    def __init__(
        self, model: PreTrainedModel, buckets: Sequence[int] = DEFAULT_BUCKETS, autotune: bool = True
    ):
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be row counts >= 1, got {list(buckets)}")
        self.model = model
        self.buckets = tuple(sorted(set(buckets)))
        self.autotune = autotune
        #: seconds spent in the first call of each bucket (compiling, or loading from the disk cache)
        self.compile_s: dict[int, float] = {}
        self._compiled = None

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket holding ``rows``, or None when the tree is larger than all."""
        return next((bucket for bucket in self.buckets if bucket >= rows), None)

    def _graph(self):
        if self._compiled is None:
            _use_jetflow_caches()
            import torch._dynamo
            import torch._inductor.config as inductor

            torch._dynamo.config.automatic_dynamic_shapes = False  # only the marked history length
            limit = max(torch._dynamo.config.recompile_limit, 2 * len(self.buckets))
            torch._dynamo.config.recompile_limit = limit
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
            inductor.freezing = True
            if self.autotune:
                inductor.max_autotune = True
                inductor.max_autotune_gemm_backends = "CPP,ATEN"
            # transformers installs its hidden-state capturing hooks on the first forward that asks
            # for them, under a lock dynamo cannot trace: one eager token installs them beforehand
            self.model(
                input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.model.device),
                output_hidden_states=True,
            )
            self._compiled = torch.compile(self._forward, dynamic=False, fullgraph=True)
        return self._compiled

    def _forward(self, input_ids: Tensor, position_ids: Tensor, mask: Tensor, keys, values):
        stop = mask.shape[-1]
        start = stop - input_ids.shape[1]
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            cache=_SlabWindow(keys, values, start, stop),
            use_cache=True,
            output_hidden_states=True,
        )
        return out.logits, out.hidden_states

    @torch.inference_mode()
    def __call__(
        self, cache: DynamicCache, tokens: Tensor, positions: Tensor, visible: Tensor
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Run ``tokens`` ``[n]`` at ``positions`` ``[n]`` after the cached history.

        ``visible`` ``[n, history + n]`` (bool) says which cached and new positions each row
        attends to. Appends the rows to ``cache`` (a slab cache) like an eager forward would.
        Returns logits ``[n, vocab]`` and the hidden states, each ``[n, hidden]``.
        """
        n = int(tokens.shape[0])
        rows = self.bucket(n)
        if rows is None:
            raise ValueError(f"no bucket holds {n} rows (largest {self.buckets[-1]})")
        layers = slab_layers(cache)
        if layers is None:
            raise ValueError("the compiled forward writes into a slab cache (kv_cache.slab_cache)")
        history = layers[0].length
        length = history + rows
        pad = rows - n
        device, dtype = tokens.device, self.model.dtype
        if pad:
            tokens = torch.cat([tokens, tokens[:1].expand(pad)])
            positions = torch.cat([positions, positions[:1].expand(pad)])
            visible = _padded_visibility(visible, history, pad)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(
            ~visible, torch.finfo(dtype).min
        )
        mask = mask[None, None]
        for layer in layers:
            layer.reserve(length + 1)  # never exactly full: capacity == L would be specialised on
        keys = [layer.key_slab for layer in layers]
        values = [layer.value_slab for layer in layers]
        torch._dynamo.mark_dynamic(mask, 3, min=rows + 1, max=_LONGEST)
        # The slabs outlive this call and every bucket's graph reads them: a range marked here
        # would stay on them beside the next bucket's, so their length is only allowed to vary.
        for slab in (*keys, *values):
            torch._dynamo.maybe_mark_dynamic(slab, 2)
        first = rows not in self.compile_s
        started = time.perf_counter()
        logits, hidden = self._graph()(tokens[None], positions[None], mask, keys, values)
        if first:
            self.compile_s[rows] = time.perf_counter() - started
            log.info("compiled target graph for %d rows in %.1f s", rows, self.compile_s[rows])
        for layer in layers:
            layer.set_length(history + n)
        return logits[0, :n], tuple(state[0, :n] for state in hidden)


def _padded_visibility(visible: Tensor, history: int, pad: int) -> Tensor:
    """``visible`` grown by ``pad`` rows and columns: real rows never see a padding row, and each
    padding row sees only itself (a row with nothing visible would give NaN scores)."""
    n = visible.shape[0]
    grown = torch.zeros(n + pad, history + n + pad, dtype=torch.bool, device=visible.device)
    grown[:n, : history + n] = visible
    index = torch.arange(n, n + pad, device=visible.device)
    grown[index, history + index] = True
    return grown
