"""The target's verify forward compiled ahead of time: one package per tree-size bucket, kept on disk.

Eager matrix kernels handle the few rows of a small tree badly on a CPU, and a one-token step of
a small model is dominated by per-operator framework overhead. Compiling the whole forward with
``freezing`` folds the weights into constants that inductor packs once for its kernels, fuses the
elementwise work and drops the dispatch; with ``autotune`` inductor's C++ GEMM template competes
with the library kernels for each matrix shape.

A compile takes minutes, and an in-process ``torch.compile`` graph with frozen, prepacked weights
cannot be cached across processes (inductor refuses to pickle oneDNN tensors): every process would
pay the minutes again. So each bucket is exported (``torch.export``) and compiled by AOTInductor
into a package under :func:`compiled_dir`, keyed by the model, torch, the processor's kernels and
the thread count: the first process that needs a bucket builds it, every later one loads it in
seconds.
``jetflow calibrate --compile`` builds the buckets ahead of time; a run that did not ask to
compile uses the buckets already built and verifies other tree sizes eagerly, so a first run on a
new machine never waits for a compile. :func:`build_package` and :func:`load_package` serve any
module the same way (a drafter compiles its head's step beside the target's buckets).

Shapes: a package serves a fixed number of rows (a *bucket*; a smaller tree is padded with rows
nobody sees and whose outputs are dropped), while the length of the KV history and the slab's
capacity are symbolic, so one package serves every context. The KV history is the slab of
:mod:`jetflow.core.kv_cache`: the compiled forward writes the new rows' keys and values in place and
attends over the filled part.

Compiled kernels round differently from eager ones (and from each other across buckets), so this
path is exact per shape, not bitwise equal to ``transformers.generate``; the lossless checks
classify each divergence as a near-tie or a bug.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from jetflow.core.atomic import atomic_path
from jetflow.core.cache_root import cache_root
from jetflow.core.kv_cache import slab_cache, slab_layers
from jetflow.core.packed_weights import unpacked
from jetflow.core.precision import cpu_kernels, cpu_model
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

log = logging.getLogger(__name__)

#: row counts a package is built for; a tree runs in the smallest bucket that holds it. One row
#: is a plain step; the others are the sizes of full trees of the budgets a calibration chooses
#: among (a root and B nodes: 1, 2, 4, 8, 16, 32), so a full tree is never padded.
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 3, 5, 9, 17, 33)
#: where inductor keeps its caches (autotuning results, compiled kernels)
INDUCTOR_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
#: what changes in the exported forward's signature bump, so that older packages are not loaded
PACKAGE_FORMAT = 1
#: the upper bound of the symbolic history length and slab capacity (no context is this long)
_LONGEST = 1 << 24
#: the history length of the example a bucket is exported with (any length >= 2 would do)
_EXAMPLE_HISTORY = 8
#: a bucket's package, in its folder ``rows-<bucket>``
_PACKAGE_FILE = "forward.pt2"


def inductor_cache_dir() -> Path:
    """Where inductor keeps autotuning results and compiled kernels: under jetflow's cache."""
    return cache_root() / "inductor"


def compiled_dir() -> Path:
    """Where the compiled packages live, one folder per model, torch version and processor."""
    return cache_root() / "compiled"


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


def package_key(model: PreTrainedModel, autotune: bool) -> str:
    """What a package was built for: the model's configuration, dtype and weights (a strided
    sample of every tensor, enough to tell two checkpoints of one architecture apart), torch's
    version, the processor and the kernels torch runs on it, the threads (inductor's kernels are
    generated and their GEMMs blocked for a thread count) and whether GEMMs were autotuned."""
    digest = hashlib.sha256()
    machine = (torch.__version__, cpu_model(), cpu_kernels(), torch.get_num_threads())
    facts = (model.config.to_json_string(), model.dtype, *machine)
    digest.update(repr((*facts, autotune, PACKAGE_FORMAT)).encode())
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 256)][:256].float().cpu()
        digest.update(f"{name}{tuple(tensor.shape)}".encode() + sample.numpy().tobytes())
    return digest.hexdigest()[:20]


def build_package(
    module: torch.nn.Module,
    example: tuple[object, ...],
    dynamic_shapes: tuple[object, ...],
    path: Path,
    autotune: bool,
) -> None:
    """Export ``module`` on ``example`` inputs and compile it by AOTInductor into ``path``, with
    the weights frozen into constants (inductor packs them for its own kernels) and, with
    ``autotune``, inductor's C++ GEMM template timed against the library kernels per shape.

    The package appears whole or not at all (a build cut short leaves nothing to load)."""
    _use_jetflow_caches()
    with unpacked(module), torch.no_grad():  # inductor packs the weights its own way
        program = torch.export.export(module, example, dynamic_shapes=dynamic_shapes, strict=False)
    options: dict[str, object] = {"freezing": True}
    if autotune:
        # the progress line is jetflow's warning, not inductor's table of timings per GEMM
        options |= {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
        options["autotune_num_choices_displayed"] = 0
    with atomic_path(path.parent, replace=False) as staging:
        staging.mkdir()
        torch._inductor.aoti_compile_and_package(
            program, package_path=str(staging / path.name), inductor_configs=options
        )


def load_package(path: Path, build: Callable[[], None], what: str) -> tuple[Callable[..., Any], float, bool]:
    """The compiled program of the package at ``path``, which ``build`` (a :func:`build_package`
    call) writes first where it is missing; with the seconds that took and whether it built.
    ``what`` names the program in the progress lines ("the target for 3-node trees")."""
    started = time.perf_counter()
    built = not path.is_file()
    if built:
        log.warning("compiling %s: minutes, once on this machine", what)
        build()
    program = torch._inductor.aoti_load_package(str(path))
    seconds = time.perf_counter() - started
    log.info("%s %s in %.1f s", "compiled" if built else "loaded", what, seconds)
    return program, seconds, built


def built_buckets(
    model: PreTrainedModel, buckets: Sequence[int] = DEFAULT_BUCKETS, autotune: bool = True
) -> list[int]:
    """The buckets whose packages for ``model`` are on disk, as this process would load them."""
    folder = compiled_dir() / package_key(model, autotune)
    return [rows for rows in buckets if _package_path(folder, rows).is_file()]


def _package_path(folder: Path, rows: int) -> Path:
    return folder / f"rows-{rows}" / _PACKAGE_FILE


class _SlabWindow:
    """The cache the model sees inside a compiled graph: per layer, the slab's first ``L`` positions.

    ``L`` (the history plus this forward's rows) is the mask's last dimension; the new rows' keys
    and values are written at ``L - rows .. L`` in place. The whole slab is the program's input,
    its capacity a symbolic dimension like ``L``, so that one package serves a slab of any size
    (a slab grows when a generation outruns it).
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


class _ExportedForward(torch.nn.Module):
    """The forward a package holds: ``(input_ids, position_ids, mask, keys, values)`` to the logits
    and hidden states of the new rows, their keys and values written into the slabs in place."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, mask: Tensor, keys: list[Tensor], values: list[Tensor]
    ):
        stop = mask.shape[-1]
        torch._check(stop <= keys[0].shape[2])  # the slab holds the history and the new rows
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            cache=_SlabWindow(keys, values, stop - input_ids.shape[1], stop),
            use_cache=True,
            output_hidden_states=True,
        )
        return out.logits, out.hidden_states


class CompiledForward:
    """The target model's tree forward, compiled per bucket of row counts into on-disk packages.

    Args:
        model: the frozen target model (any ``transformers`` causal LM of full-attention layers).
        buckets: row counts to compile for; trees larger than the largest run eagerly.
        autotune: let inductor benchmark its C++ GEMM template against the library kernels
            for every matrix shape (slower to build, faster small-row products).
        build: build a bucket's package on its first use when none is on disk (minutes); False
            uses only the packages already built and leaves other tree sizes to the eager forward.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        autotune: bool = True,
        build: bool = True,
    ):
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be row counts >= 1, got {list(buckets)}")
        self.model = model
        self.buckets = tuple(sorted(set(buckets)))
        self.autotune = autotune
        self.build = build
        #: this model's packages, one sub-folder per bucket
        self.folder = compiled_dir() / package_key(model, autotune)
        #: seconds the first call of each bucket took: building its package, or loading it
        self.compile_s: dict[int, float] = {}
        #: the buckets this process built (the others it used were loaded)
        self.built: set[int] = set()
        self._runners: dict[int, Callable[..., Any]] = {}
        #: the buckets whose packages were on disk when this forward was made
        self._on_disk = {bucket for bucket in self.buckets if self.package(bucket).is_file()}

    def package(self, rows: int) -> Path:
        """The package file of the ``rows`` bucket."""
        return _package_path(self.folder, rows)

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket holding ``rows`` that this forward serves, or None (eager)."""
        return next((bucket for bucket in self.buckets if bucket >= rows and self._serves(bucket)), None)

    def _serves(self, bucket: int) -> bool:
        return self.build or bucket in self._runners or bucket in self._on_disk

    def load(self, rows: int) -> None:
        """Load now every built package a tree of up to ``rows`` nodes can run in (seconds each),
        so that no generation pays for one in the middle of its decoding; builds nothing."""
        largest = self.bucket(rows) or self.buckets[-1]
        for bucket in self.buckets:
            if bucket <= largest and (bucket in self._on_disk or self.package(bucket).is_file()):
                self._runner(bucket)

    def _runner(self, rows: int):
        runner = self._runners.get(rows)
        if runner is None:
            what = f"the target for {rows}-node trees"
            runner, self.compile_s[rows], built = load_package(
                self.package(rows), lambda: self._build(rows), what
            )
            self._runners[rows] = runner
            if built:
                self.built.add(rows)
        return runner

    def _build(self, rows: int) -> None:
        """Export the forward for ``rows`` new rows and compile it into :meth:`package`."""
        history = _EXAMPLE_HISTORY
        cache = slab_cache(self.model, 1, history + rows + 1)
        layers = slab_layers(cache) or []
        example = (
            torch.zeros(1, rows, dtype=torch.long, device=self.model.device),
            torch.arange(history, history + rows, device=self.model.device)[None],
            torch.zeros(1, 1, rows, history + rows, dtype=self.model.dtype, device=self.model.device),
            [layer.key_slab for layer in layers],
            [layer.value_slab for layer in layers],
        )
        length = torch.export.Dim("length", min=rows + 1, max=_LONGEST)
        capacity = {2: torch.export.Dim("capacity", min=rows + 1, max=_LONGEST)}  # >= length
        fixed: dict[int, object] = {}  # the token and position inputs: every dimension static
        shapes = (fixed, fixed, {3: length}, [capacity] * len(layers), [capacity] * len(layers))
        # transformers installs its hidden-state capturing hooks on the first forward that asks
        # for them, under a lock tracing cannot enter: one eager token installs them beforehand
        self.model(input_ids=example[0][:, :1], output_hidden_states=True)
        build_package(_ExportedForward(self.model), example, shapes, self.package(rows), self.autotune)

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
            raise ValueError(f"no bucket holds {n} rows (buckets {list(self.buckets)})")
        layers = slab_layers(cache)
        if layers is None:
            raise ValueError("the compiled forward writes into a slab cache (kv_cache.slab_cache)")
        history = layers[0].length
        pad = rows - n
        device, dtype = tokens.device, self.model.dtype
        if pad:
            tokens = torch.cat([tokens, tokens[:1].expand(pad)])
            positions = torch.cat([positions, positions[:1].expand(pad)])
            visible = _padded_visibility(visible, history, pad)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(
            ~visible, torch.finfo(dtype).min
        )
        for layer in layers:
            layer.reserve(history + rows)
        keys = [layer.key_slab for layer in layers]
        values = [layer.value_slab for layer in layers]
        logits, hidden = self._runner(rows)(tokens[None], positions[None], mask[None, None], keys, values)
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
