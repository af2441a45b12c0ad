"""The methods of a comparison run, all sharing one loaded target.

``ar`` (the engine loop without a drafter) comes first: it is the reference for speedups
and for the lossless check. Then the transformers peers, then each drafter at each budget,
then (``vllm``) vLLM's methods, measured against plain vLLM.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from jetflow.bench.config import AR, HF_GENERATE, HF_PROMPT_LOOKUP, BenchConfig
from jetflow.bench.generation import BatchGeneration, BatchMethod, Generation, Method
from jetflow.bench.hf_baselines import HFGenerateMethod
from jetflow.core.calibration import (
    Calibration,
    CalibrationKey,
    calibrate,
    calibration_path,
    install_calibration,
    key_for,
    load_or_calibrate,
    save_calibration,
    with_batches,
)
from jetflow.core.config import AUTO_BUDGET, NO_DRAFTER, GenerateConfig, TreeConfig
from jetflow.core.engine import Engine
from jetflow.core.errors import ConfigError
from jetflow.core.registry import Registry, default_registry
from jetflow.core.result import GenerationResult
from jetflow.core.target import Target

log = logging.getLogger(__name__)


class EngineMethod(BatchMethod):
    """The jetflow engine loop: ``ar`` without a drafter, else a drafter at one budget."""

    batchable = True

    def __init__(self, name: str, engine: Engine) -> None:
        self.name = name
        self.engine = engine
        self.budget = engine.budget
        self.policy = engine.policy.name if engine.drafter else None

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Generation:
        return self._generation(self.engine.generate(list(prompt_ids), max_new_tokens=max_new_tokens))

    def generate_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int
    ) -> BatchGeneration:
        """Every prompt through one :meth:`Engine.generate_batch` call (continuous batching).

        A forward is recorded once in each row it verified (``StepRecord.rows`` of them), so
        sums over the rows' steps weigh each record by ``1 / rows`` to count it once.
        """
        start = time.perf_counter()
        results = self.engine.generate_batch(
            [list(prompt) for prompt in prompts], max_new_tokens=max_new_tokens, batch_size=batch_size
        )
        wall = time.perf_counter() - start
        steps = [step for result in results for step in result.steps]
        totals: dict[int, float] = {}
        for step in steps:
            totals[step.batch_budget] = totals.get(step.batch_budget, 0.0) + 1 / step.rows
        return BatchGeneration(
            rows=tuple(self._generation(result) for result in results),
            wall_s=wall,
            forwards=round(sum(1 / step.rows for step in steps)),
            row_steps=len(steps),
            draft_s=sum(step.draft_s / step.rows for step in steps),
            verify_s=sum(step.verify_s / step.rows for step in steps),
            batch_budgets={str(total): round(totals[total]) for total in sorted(totals)}
            if self.budget is not None
            else None,
        )

    def _generation(self, result: GenerationResult) -> Generation:
        return Generation(
            token_ids=tuple(result.token_ids),
            wall_s=result.wall_s,
            steps=len(result.steps),
            draft_s=result.draft_s,
            verify_s=result.verify_s,
            accepted=tuple(step.accepted for step in result.steps),
            budgets=tuple(step.budget for step in result.steps) if self.budget is not None else None,
            prefill_s=result.prefill_s,
        )


def engine_config(
    config: BenchConfig, drafter: str, tree: TreeConfig | None = None, params: dict | None = None
) -> GenerateConfig:
    """The engine configuration of one method of the run (``tree`` None: the drafter's defaults)."""
    fields = {"target": config.target, "dtype": config.dtype, "drafter": drafter, "seed": config.seed}
    fields["compile"] = config.compile
    fields |= config.verifier_fields()
    if tree is not None:
        fields.update(tree=tree, drafter_params=params or {})
    return GenerateConfig(**fields)


def auto_configs(config: BenchConfig) -> list[GenerateConfig]:
    """The engine configurations of the run's ``auto`` budgets (each starts from a calibration)."""
    if AUTO_BUDGET not in config.budgets:
        return []
    return [
        engine_config(config, spec.drafter, config.tree_config(spec, AUTO_BUDGET), config.params_of(spec))
        for spec in config.drafter_specs
    ]


def calibrate_auto_runs(
    config: BenchConfig,
    target: Target,
    registry: Registry | None = None,
    progress: bool = False,
    kept: Path | None = None,
    resume: bool = False,
) -> list[CalibrationKey]:
    """Measure and cache, before anything is timed, the calibration each ``auto`` run starts from,
    where this machine has none: the one ``jetflow calibrate`` makes with its defaults, so a
    comparison with ``auto`` runs on a fresh machine with no step by hand. Returns what it measured.

    ``kept`` (the results folder's copy) holds the calibrations the results were measured from:
    each one used is written there, and a ``resume`` starts from the one kept for this machine
    kind rather than a new measurement, so a data set stopped part-way goes on from the same
    starting budget in a later session, where the machine's own cache is gone. With the batch
    axis, each calibration also holds the step costs of the run's batch sizes (measured where it
    lacks them), which the adaptive budget prices a batch's steps with.
    """
    measured = []
    rows = {size for size in config.batch_sizes or () if size > 1}
    for generate in auto_configs(config):
        key = key_for(generate, target, registry)
        copy = None if kept is None else kept / calibration_path(key).name
        if resume and copy is not None and copy.is_file():
            try:
                install_calibration(copy, key)
            except ConfigError as error:
                log.warning("measuring anew: %s", error)
        measure = partial(_announced_calibration, key, generate, target, registry, progress)
        calibration, fresh = load_or_calibrate(key, measure)
        # a batch's steps are priced by what a step of that many rows costs: measure the bench's sizes
        missing = sorted(rows - {batch.rows for batch in calibration.batches})
        if missing:
            sizes = ", ".join(map(str, missing))
            log.warning("measuring %s-row steps of %s for its 'auto' runs (cached)", sizes, key.describe())
            save_calibration(with_batches(calibration, generate, target, missing, registry=registry))
            fresh = True
        if fresh:
            measured.append(key)
        if copy is not None:
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(calibration_path(key), copy)
    return measured


def _announced_calibration(
    key: CalibrationKey, config: GenerateConfig, target: Target, registry: Registry | None, progress: bool
) -> Calibration:
    log.warning("measuring the calibration of %s for its 'auto' runs (cached)", key.describe())
    return calibrate(config, target, registry=registry, progress=progress)


def build_methods(config: BenchConfig, target: Target, registry: Registry | None = None) -> list[Method]:
    """Every method of a run, ``ar`` first (the reference for speedups and losslessness)."""
    registry = registry or default_registry()

    def engine(drafter: str, tree: TreeConfig | None = None, params: dict | None = None) -> Engine:
        return Engine.from_cache(engine_config(config, drafter, tree, params), target, registry)

    methods: list[Method] = [EngineMethod(AR, engine(NO_DRAFTER))]
    if HF_GENERATE in config.baselines:
        methods.append(HFGenerateMethod(HF_GENERATE, target, temperature=config.temperature))
    if HF_PROMPT_LOOKUP in config.baselines:
        methods.append(
            HFGenerateMethod(
                HF_PROMPT_LOOKUP,
                target,
                prompt_lookup_num_tokens=config.prompt_lookup_tokens,
                temperature=config.temperature,
            )
        )
    for spec in config.drafter_specs:
        params = config.params_of(spec)
        for budget in config.budgets:
            tree = config.tree_config(spec, budget)
            # "auto" resolves to a calibrated integer; its own name keeps it apart from that fixed run
            name = f"{spec.method}@{AUTO_BUDGET}" if budget == AUTO_BUDGET else spec.method
            methods.append(EngineMethod(name, engine(spec.drafter, tree, params)))
    if config.vllm:
        from jetflow.bench.vllm_methods import build_vllm_methods

        methods += build_vllm_methods(config, target, registry)
    return methods
