"""vLLM as a peer in the comparison: ``vllm``, ``vllm-ngram`` and ``vllm-<drafter>``, on the same prompts.

vLLM cannot be imported beside jetflow (it pins an older transformers), so each method is
a worker process of ``.venv-vllm`` (``make vllm``) running :mod:`jetflow.bench.vllm_worker`,
loaded once and fed prompt token ids over a pipe; it times its own generations, so the pipe
is not in the figures. ``vllm`` is plain greedy decoding and the reference of the other
vLLM methods (their speedups and the lossless check); ``vllm-ngram`` is vLLM's prompt
lookup; ``vllm-<drafter>`` serves the drafter's head exported by :mod:`jetflow.export`,
drafting a chain as long as each budget of the run (one engine per length). A drafter whose
head does not export is left out with the reason. Every engine runs with prefix caching off,
like jetflow, which prefills each prompt from scratch.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from jetflow.bench.config import BenchConfig
from jetflow.bench.generation import Generation, Method
from jetflow.core.config import Budget
from jetflow.core.errors import ConfigError, JetflowError
from jetflow.core.precision import dtype_name
from jetflow.core.registry import Registry
from jetflow.core.target import Target

if TYPE_CHECKING:
    from jetflow.export.schema import DFlashConfig, Eagle3Config

log = logging.getLogger(__name__)

VLLM = "vllm"
VLLM_NGRAM = "vllm-ngram"
VLLM_PREFIX = "vllm-"
#: where ``make vllm`` puts vLLM's environment; ``JETFLOW_VLLM_PYTHON`` names another interpreter
VLLM_VENV = ".venv-vllm"
WORKER = Path(__file__).with_name("vllm_worker.py")
#: the KV-cache reservation per engine (GiB): one sequence of a few thousand tokens needs ~0.1
_KV_CACHE_GIB = "1"


def vllm_python() -> Path:
    """The interpreter of vLLM's environment, or a clear error saying how to make it."""
    override = os.environ.get("JETFLOW_VLLM_PYTHON")
    python = (
        Path(override) if override else Path(__file__).resolve().parents[1] / VLLM_VENV / "bin" / "python"
    )
    if not python.is_file():
        raise ConfigError(
            f"vLLM's environment is missing ({python}): run `make vllm` or set JETFLOW_VLLM_PYTHON"
        )
    return python


class VllmWorker:
    """One loaded vLLM engine in its own process (see :mod:`jetflow.bench.vllm_worker`)."""

    def __init__(self, settings: dict[str, Any], log_path: Path, threads: int | None = None) -> None:
        env = os.environ | {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": _KV_CACHE_GIB}
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        self.log_path = log_path
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [str(vllm_python()), str(WORKER), json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        assert self.process.stdin is not None and self.process.stdout is not None  # both pipes above
        self._requests: IO[str] = self.process.stdin
        self._replies: IO[str] = self.process.stdout
        self.load_s = float(self._read()["load_s"])

    def _read(self) -> dict[str, Any]:
        line = self._replies.readline()
        if not line:
            self.process.wait()
            tail = self.log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
            raise JetflowError(
                f"the vLLM worker exited ({self.process.returncode}): {tail[0]} [log: {self.log_path}]"
            )
        return json.loads(line)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[int]) -> dict[str, Any]:
        request = {
            "prompt_ids": list(prompt_ids),
            "max_new_tokens": max_new_tokens,
            "stop_token_ids": list(stop),
        }
        self._requests.write(json.dumps(request) + "\n")
        self._requests.flush()
        return self._read()

    def close(self) -> None:
        if self.process.poll() is None:
            self._requests.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._log.close()


def accepted_per_step(reply: dict[str, Any]) -> tuple[int, ...]:
    """Drafted tokens accepted per step, rebuilt from vLLM's counters (counts exact, order not).

    ``accepted_per_pos[i]`` counts the drafts whose position ``i`` was accepted, so the
    drafts that accepted exactly ``k`` tokens are ``per_pos[k-1] - per_pos[k]``. Every step
    emits one token more than it accepted, so steps = tokens - accepted; the steps beyond
    the drafts (the prefill's, and steps where prompt lookup found nothing) accepted none.
    """
    per_pos = [*reply["accepted_per_pos"], 0]
    tokens = len(reply["token_ids"])
    steps = max(tokens - reply["accepted_tokens"], 1)
    counts = [reply["drafts"] - per_pos[0]] + [per_pos[k - 1] - per_pos[k] for k in range(1, len(per_pos))]
    counts[0] += max(steps - reply["drafts"], 0)
    return tuple(k for k, count in enumerate(counts) for _ in range(max(count, 0)))


class VllmMethod(Method):
    """One vLLM configuration meeting the :class:`~jetflow.bench.generation.Method` contract."""

    #: the method its speedup and lossless check are measured against
    reference = VLLM

    def __init__(self, name: str, worker: VllmWorker, stop: Iterable[int], tokens: int | None = None) -> None:
        self.name = name
        self.worker = worker
        self.stop = tuple(sorted(stop))
        self.budget = tokens
        self.policy = "chain" if tokens is not None else None
        #: drafters whose heads did not export, with the reason (kept on ``vllm``)
        self.left_out: dict[str, str] = {}

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Generation:
        reply = self.worker.generate(prompt_ids, max_new_tokens, self.stop)
        accepted = accepted_per_step(reply)
        return Generation(
            token_ids=tuple(reply["token_ids"]),
            wall_s=float(reply["wall_s"]),
            steps=len(accepted),
            draft_s=0.0,  # vLLM does not report its drafting time per request
            verify_s=0.0,
            accepted=accepted,
            budgets=None if self.budget is None else (self.budget,) * len(accepted),
        )


def engine_settings(config: BenchConfig, target: Target, model: str) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments shared by every vLLM method of a run."""
    return {
        "model": model,
        "dtype": dtype_name(target.dtype),
        "seed": config.seed,
        "max_model_len": min(target.context_length, 4096),
        # what a 24 GB machine leaves (REFERENCE.md); on a CPU the KV cache is VLLM_CPU_KVCACHE_SPACE
        "gpu_memory_utilization": 0.3,
        "enable_prefix_caching": False,
        "disable_log_stats": False,  # the spec-decode counters come from the stats
    }


def build_vllm_methods(config: BenchConfig, target: Target, registry: Registry | None = None) -> list[Method]:
    """``vllm`` first, then ``vllm-ngram``, then one method per drafter whose head exports.

    A drafter left out is named, with its export error, in ``left_out`` of the ``vllm``
    method (the runner records it in the results' settings). The workers close and the
    exported heads are removed when the process exits; the engines' logs stay.
    """
    from jetflow.export.exporter import build_export, verifier_for
    from jetflow.export.folder import write_export

    if not config.greedy:
        raise ConfigError("--vllm compares greedy outputs: run it at temperature 0")
    folder = Path(tempfile.mkdtemp(prefix="jetflow-vllm-"))
    base = engine_settings(config, target, verifier_for(config.target))
    stop = target.eos_token_ids

    def method(name: str, speculative: dict[str, Any] | None = None) -> VllmMethod:
        settings = base | ({"speculative_config": speculative} if speculative else {})
        log.info("loading vLLM for %s (minutes on a CPU)", name)
        worker = VllmWorker(settings, folder / f"{name}.log", config.threads)
        atexit.register(worker.close)
        log.info("%s loaded in %.0f s", name, worker.load_s)
        tokens = speculative["num_speculative_tokens"] if speculative else None
        return VllmMethod(name, worker, stop, tokens)

    ngram = {
        "method": "ngram",
        "num_speculative_tokens": config.vllm_ngram_tokens,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    plain = method(VLLM)
    methods: list[Method] = [plain, method(VLLM_NGRAM, ngram)]
    for label in dict.fromkeys(spec.label for spec in config.drafter_specs):
        spec = next(s for s in config.drafter_specs if s.label == label)
        try:
            export = build_export(
                spec.drafter, target, config.target, params=config.params_of(spec), registry=registry
            )
        except JetflowError as error:
            plain.left_out[label] = str(error)
            log.warning("vllm-%s left out: %s", label, error)
            continue
        path = write_export(export, folder / f"head-{label}")
        atexit.register(shutil.rmtree, path, True)
        for tokens in chain_lengths(export.config, config.budgets):
            speculative = {
                "method": export.config.speculators_model_type,
                "model": str(path),
                "num_speculative_tokens": tokens,
            }
            methods.append(method(VLLM_PREFIX + label, speculative))
    return methods


def chain_lengths(export: DFlashConfig | Eagle3Config, budgets: Sequence[Budget]) -> list[int]:
    """The drafted tokens per step of one ``vllm-<drafter>`` engine per fixed budget of the run.

    vLLM drafts a chain, so a budget of ``B`` nodes is ``B`` tokens, as in jetflow's chain
    policy (bounded by the head, see ``chain_tokens``); budgets that come to the same length
    share an engine. With only ``auto`` budgets the head drafts what its folder says.
    """
    fixed = [budget for budget in budgets if isinstance(budget, int) and budget > 0]
    if not fixed:
        return [export.speculative_tokens]
    return sorted({export.chain_tokens(budget) for budget in fixed})
