"""The calibration harness: measure what a step costs here and how much it accepts, choose the budget.

The budget that pays off depends on the hardware and the load (the JetFlow paper's best budgets
are 128-256 nodes on an H100; a 2-core CPU pays for far fewer), so it is measured, not fixed:

* ``T(n)``: the target's verify latency for a tree of ``n`` nodes (the real
  :meth:`Target.verify`, acceptance and commit on real trees; medians after warm-up),
  measured at every candidate's own tree size ``B + 1`` and on a grid between them.
  Interpolation alone misleads: the matrix kernels' blocking makes ``T`` a staircase, so
  the line between two grid sizes can miss a candidate's own size by a wide margin. Batch
  size is 1: the engine decodes one sequence at a time.
* ``tau(B)`` and the draft cost per step at budget ``B``: the engine itself on a few
  calibration prompts (never benchmark prompts), with draft time = ``drafter.begin`` plus
  the policy's build, exactly as the loop spends it.
* expected tokens/s (:mod:`jetflow.core.cost_model`) ``= tau(B) / (draft(B) + verify(B))``
  where ``verify(B)`` averages ``T`` over the trees actually built at ``B``. That is
  ``T(B + 1)`` when the drafter fills its budget; a prompt-lookup drafter often cannot, and
  charging it for nodes it never drafted would bias the choice against large budgets.

Budgets are measured smallest first and the search stops once the expected speed has
clearly peaked, so a CPU never spends minutes on 256-node trees it would not choose.
The records live in :mod:`jetflow.core.calibration_record`, their cache in
:mod:`jetflow.core.calibration_store`; both are re-exported here, the one module callers need.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

import numpy as np
import torch
from jetflow.core.calibration_record import (
    SCHEMA_VERSION,
    BatchPoint,
    BudgetPoint,
    Calibration,
    CalibrationKey,
    MachineKey,
    no_drafting_point,
)
from jetflow.core.calibration_store import (
    BudgetSource,
    cached_calibration,
    calibrate_command,
    calibration_path,
    install_calibration,
    load_calibration,
    save_calibration,
)
from jetflow.core.config import GenerateConfig
from jetflow.core.contracts import Drafter, Verifier
from jetflow.core.cost_model import (
    CHOICE_TOLERANCE,
    EARLY_STOP_FRACTION,
    choose_budget,
    expected_tokens_per_s,
    interpolate_latency,
    past_the_peak,
)
from jetflow.core.engine import Engine
from jetflow.core.errors import ConfigError
from jetflow.core.target import Target
from jetflow.core.tree import DraftTree
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from jetflow.core.engine import Prompt
    from jetflow.core.registry import Registry

log = logging.getLogger(__name__)

#: tokens per sequence decoded to measure a batched step's cost, in each of this many rounds
BATCH_STEP_TOKENS = 16
BATCH_ROUNDS = 3

__all__ = [
    "CALIBRATION_PROMPTS",
    "CHOICE_TOLERANCE",
    "DEFAULT_BUDGETS",
    "DEFAULT_TREE_SIZES",
    "EARLY_STOP_FRACTION",
    "SCHEMA_VERSION",
    "BudgetPoint",
    "BudgetSource",
    "Calibration",
    "CalibrationKey",
    "MachineKey",
    "cached_calibration",
    "calibrate",
    "calibrate_command",
    "calibration_path",
    "choose_budget",
    "engine_at",
    "ensure_calibration",
    "expected_tokens_per_s",
    "install_calibration",
    "interpolate_latency",
    "key_for",
    "load_calibration",
    "load_or_calibrate",
    "measure_verify_latency",
    "no_drafting_point",
    "past_the_peak",
    "save_calibration",
    "with_batches",
]

#: budgets whose acceptance is measured (each one an engine run per prompt). From 15 on, a
#: budget's tree (root included) fills a whole number of 16-row blocks: matrix units work on row
#: tiles of 16 (AMX; GPU tensor cores on multiples of it), so one more node would start a
#: tile, and the verify cost steps up at 17 and 33 rows while one drafted node adds little tau.
DEFAULT_BUDGETS: tuple[int, ...] = (1, 2, 4, 8, 15, 31, 63, 127, 255)
#: tree sizes (root included) whose verify latency is measured; others are interpolated
DEFAULT_TREE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
#: the budgets a first-use calibration measures (``jetflow calibrate`` searches all of DEFAULT_BUDGETS)
FIRST_USE_BUDGETS: tuple[int, ...] = (1, 2, 4, 8, 15, 31)

#: Calibration prompts: short, varied (code, arithmetic, explanation, rewriting, data formats)
#: and written for this module, so no benchmark (CHAMP, HumanEval, MT-Bench) or training
#: prompt leaks into the budget choice. Ordered so that any prefix is still varied.
CALIBRATION_PROMPTS: tuple[str, ...] = (
    "Write a Python function that returns the n-th Fibonacci number iteratively, "
    "then show how to call it for n = 10.",
    "A train travels 180 km in 2 hours and then 120 km in 1.5 hours. What is its average speed "
    "over the whole trip? Show each step.",
    "Explain in one short paragraph why the sky looks blue during the day and red at sunset.",
    'Convert this JSON object to YAML: {"name": "jetflow", "version": 1, "tags": ["fast", "lossless"], '
    '"owner": {"team": "inference", "contact": "ops@example.com"}}',
    "Rewrite this message in a formal tone: 'hey, can u send me the report by tomorrow? thx'",
    "Write a SQL query that lists the ten customers with the highest total order amount, given "
    "tables customers(id, name) and orders(id, customer_id, amount).",
    "List five practical tips for keeping a small vegetable garden healthy in hot weather.",
    "Summarise, in three sentences, a story in which a lighthouse keeper finds a message in a bottle.",
)


def engine_at(
    config: GenerateConfig, target: Target, budget: int, registry: Registry | None = None
) -> Engine:
    """An engine for ``config`` at a fixed ``budget`` (so it never looks for a calibration)."""
    tree = config.tree.model_copy(update={"budget": budget})
    return Engine(config.model_copy(update={"tree": tree}), target, registry)


def drafter_of(engine: Engine) -> Drafter:
    """The engine's drafter: only a drafted config is calibrated."""
    if engine.drafter is None:
        raise ConfigError("calibration needs a drafter (the budget of plain decoding is always 0)")
    return engine.drafter


def ensure_calibration(
    config: GenerateConfig,
    target: Target,
    registry: Registry | None = None,
    progress: bool = True,
    announce: Callable[[str], object] | None = None,
) -> Calibration | None:
    """The cached calibration of ``config`` on ``target``; measured now and cached if there is none.

    Without a calibration an engine cannot know whether a tree pays on this machine (on a
    processor without fast bf16 even a few nodes may cost more than they accept), so a run
    whose budget is left to jetflow measures once, on first use: a shorter calibration than
    ``jetflow calibrate`` (fewer prompts and tokens, budgets up to :data:`FIRST_USE_BUDGETS`),
    whose choice includes budget 0, plain decoding. Later runs read it from the cache and the
    adaptive budget corrects tau online. ``announce`` gets one line saying what happens.
    Returns None where the budget is not left to jetflow: no drafter, a fixed budget, or an
    explicit ``auto`` (which asks for the calibration ``jetflow calibrate`` made, and says so).
    """
    if not config.uses_drafter or config.tree.budget is not None:
        return None
    key = key_for(config, target, registry)

    def first_use() -> Calibration:
        if announce is not None:
            announce(
                f"jetflow: first use of {key.drafter} on this machine: measuring once which tree budget "
                f"pays here (cached; `{calibrate_command(key, config.target)}` measures more)"
            )
        return calibrate(
            config,
            target,
            prompts=CALIBRATION_PROMPTS[:2],
            budgets=FIRST_USE_BUDGETS,
            max_new_tokens=32,
            repeats=3,
            warmup=1,
            registry=registry,
            progress=progress,
        )

    return load_or_calibrate(key, first_use)[0]


def load_or_calibrate(key: CalibrationKey, measure: Callable[[], Calibration]) -> tuple[Calibration, bool]:
    """The calibration cached under ``key``, else ``measure()``'s, saved; and whether it was measured
    now. A stale or corrupt record is measured again, and the new one replaces it."""
    try:
        cached = load_calibration(key)
    except ConfigError as error:
        log.warning("remeasuring: %s", error)
        cached = None
    if cached is not None:
        return cached, False
    calibration = measure()
    save_calibration(calibration)
    return calibration, True


def key_for(config: GenerateConfig, target: Target, registry: Registry | None = None) -> CalibrationKey:
    """The key under which ``config`` on ``target`` is calibrated (plugins built, nothing run)."""
    if not config.uses_drafter:
        raise ConfigError("calibration needs a drafter (the budget of plain decoding is always 0)")
    return engine_at(config, target, 1, registry).calibration_key()


def measure_verify_latency(
    target: Target,
    verifier: Verifier,
    context_ids: Sequence[int],
    sizes: Sequence[int],
    width: int = 4,
    repeats: int = 5,
    warmup: int = 2,
    layers: tuple[int, ...] = (),
    on_measure: Callable[[], object] | None = None,
) -> list[float]:
    """Median seconds of one verify step (forward, acceptance, commit) per tree size.

    ``layers`` are the drafter's feature layers (capturing them costs time too). Trees are
    complete ``width``-ary trees over tokens of the context; each repeat builds a fresh tree
    (its ancestor mask is computed inside the step, as in the engine) and crops the cache
    back afterwards, so every repeat sees the same cached prefix. The sizes are measured in
    interleaved rounds (alternating order), not one after another: on a machine whose load
    drifts, the drift then spreads over every size instead of making neighbours disagree.
    The medians are used as measured, not forced to grow with the size: the matrix kernels'
    blocking can make a larger tree verify faster than a smaller one, and the engine's steps
    then see the same. ``on_measure`` is called after every forward.
    """
    context = torch.tensor(list(context_ids), dtype=torch.long, device=target.device)  # as the engine
    cache, _ = target.prefill(context[:-1], capacity=len(context) + max(sizes))  # the engine's slab
    n_cached = cache.get_seq_length()
    generator = torch.Generator(target.device).manual_seed(0)
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for round_index in range(warmup + repeats):
        order = sizes if round_index % 2 == 0 else sizes[::-1]
        for size in order:
            tree = _verify_tree(context, size, width)
            _synchronize(target.device)
            start = time.perf_counter()
            out = target.verify(cache, tree, layers)
            decision = verifier.accept(tree, out.logits, generator)
            target.commit(cache, n_cached, decision.path)
            _synchronize(target.device)
            if round_index >= warmup:
                times[size].append(time.perf_counter() - start)
            cache.crop(n_cached - cache.get_seq_length())  # a negative count: tokens to drop
            if on_measure is not None:
                on_measure()
    return [statistics.median(times[size]) for size in sizes]


def calibrate(
    config: GenerateConfig,
    target: Target,
    prompts: Sequence[Prompt] = CALIBRATION_PROMPTS[:4],
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    tree_sizes: Sequence[int] | None = None,
    max_new_tokens: int = 64,
    repeats: int = 5,
    warmup: int = 2,
    registry: Registry | None = None,
    progress: bool = False,
    early_stop: bool = True,
    batch_sizes: Sequence[int] = (),
) -> Calibration:
    """Measure ``T(n)``, ``tau(B)`` and the draft cost, and choose the budget (not saved).

    ``config`` names the drafter, policy, tree shape and verifier; its budget is ignored.
    ``tree_sizes`` defaults to the grid up to ``max(budgets) + 1``; every ``B + 1`` is always
    measured too.
    With ``early_stop``, budgets after the expected speed has clearly peaked are skipped
    (see :func:`~jetflow.core.cost_model.past_the_peak`): on a CPU they are the slowest to
    measure and never win. ``batch_sizes`` (> 1) also measures what a step of that many
    sequences costs at every budget measured (:func:`measure_batch_point`), which the adaptive
    budget then prices a batch's steps with.
    """
    if not config.uses_drafter:
        raise ConfigError("calibration needs a drafter (the budget of plain decoding is always 0)")
    if not prompts:
        raise ConfigError("calibration needs at least one prompt")
    budgets = sorted(set(budgets))
    if not budgets or budgets[0] < 1:
        raise ConfigError(f"calibration budgets must be integers >= 1, got {budgets}")
    largest = budgets[-1] + 1
    grid = {n for n in (tree_sizes or DEFAULT_TREE_SIZES) if 1 <= n <= largest}
    sizes = sorted(grid | {1} | {budget + 1 for budget in budgets})

    first = engine_at(config, target, budgets[0], registry)
    key = first.calibration_key()
    total = len(sizes) * (warmup + repeats) + len(budgets) * len(prompts)
    with tqdm(total=total, desc="calibrating", unit="run", disable=not progress, leave=False) as bar:
        bar.set_postfix_str("verify latency")
        latency = measure_verify_latency(
            target,
            first.verifier,
            first.prompt_ids(prompts[0]),
            sizes,
            width=config.tree.width,
            repeats=repeats,
            warmup=warmup,
            layers=drafter_of(first).feature_layers,
            on_measure=bar.update,
        )
        points: list[BudgetPoint] = []
        skipped: list[int] = []
        for budget in budgets:
            if early_stop and past_the_peak([p.expected_tokens_per_s for p in points]):
                skipped.append(budget)
                bar.update(len(prompts))
                continue
            bar.set_postfix_str(f"budget {budget}")
            engine = first if budget == budgets[0] else engine_at(config, target, budget, registry)
            points.append(_measure_budget(engine, prompts, max_new_tokens, sizes, latency, bar.update))
    if skipped:
        log.info("skipped budgets %s: the expected speed had fallen past the peak", skipped)
    baseline = no_drafting_point(float(latency[0]))
    points.insert(0, baseline)
    calibration = Calibration(
        key=key,
        created=datetime.now().astimezone().isoformat(timespec="seconds"),
        tree_sizes=sizes,
        verify_latency_ms=[round(t * 1e3, 4) for t in latency],
        points=points,
        skipped_budgets=skipped,
        budget=choose_budget(
            [p.budget for p in points], [p.expected_tokens_per_s for p in points], CHOICE_TOLERANCE
        ),
        baseline_tokens_per_s=baseline.expected_tokens_per_s,
        n_prompts=len(prompts),
        max_new_tokens=max_new_tokens,
        repeats=repeats,
    )
    return with_batches(calibration, config, target, batch_sizes, prompts, registry)


def _measure_budget(
    engine: Engine,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    sizes: Sequence[int],
    latency_s: Sequence[float],
    on_prompt: Callable[[], object] | None = None,
) -> BudgetPoint:
    """tau, draft cost and modelled verify cost of the engine's budget on ``prompts``."""
    engine.generate(prompts[0], max_new_tokens=min(4, max_new_tokens))  # warm-up, untimed
    tokens, steps = 0, []
    for prompt in prompts:
        result = engine.generate(prompt, max_new_tokens=max_new_tokens)
        tokens += result.new_tokens
        steps += result.steps
        if on_prompt is not None:
            on_prompt()
    built = np.array([step.tree_size for step in steps])
    tau = tokens / len(steps)
    draft = sum(step.draft_s for step in steps) / len(steps)
    verify = float(interpolate_latency(sizes, latency_s, built).mean())
    speed = float(expected_tokens_per_s([tau], [draft], [verify])[0])
    return BudgetPoint(
        budget=engine.shape.budget,
        tau=round(tau, 4),
        draft_ms=round(draft * 1e3, 4),
        verify_ms=round(verify * 1e3, 4),
        mean_tree_size=round(float(built.mean()), 3),
        expected_tokens_per_s=round(speed, 3),
    )


def with_batches(
    calibration: Calibration,
    config: GenerateConfig,
    target: Target,
    batch_sizes: Sequence[int],
    prompts: Sequence[Prompt] = CALIBRATION_PROMPTS[:4],
    registry: Registry | None = None,
) -> Calibration:
    """``calibration`` with step costs measured at every one of ``batch_sizes`` (> 1) it lacks."""
    have = {batch.rows for batch in calibration.batches}
    missing = sorted({rows for rows in batch_sizes if rows > 1} - have)
    if not missing:
        return calibration
    budgets = [point.budget for point in calibration.points]
    added = [measure_batch_point(config, target, budgets, rows, prompts, registry) for rows in missing]
    batches = sorted([*calibration.batches, *added], key=lambda batch: batch.rows)
    return calibration.model_copy(update={"batches": batches})


def measure_batch_point(
    config: GenerateConfig,
    target: Target,
    budgets: Sequence[int],
    rows: int,
    prompts: Sequence[Prompt],
    registry: Registry | None = None,
    rounds: int = BATCH_ROUNDS,
    max_new_tokens: int = BATCH_STEP_TOKENS,
) -> BatchPoint:
    """The step costs of ``rows`` sequences at each of ``budgets``: the engine itself on ``rows``
    of the calibration prompts (cycled), its nodes spread best-first across the rows as the
    engine spreads them by default (for a nested policy, every row drafted past its share, then
    cut back: :mod:`jetflow.core.allocation`). That drafting is part of what a share costs, and an equal split
    costs no more, so for one the price is an upper bound: a calibration errs toward ``ar``.

    The budgets are measured in interleaved rounds (alternating order), as the verify latencies
    are: on a machine whose load drifts, the drift then spreads over every budget instead of
    making one budget look cheaper than its neighbour. Each budget's cost is the median of its
    rounds' means."""
    batch = [prompts[index % len(prompts)] for index in range(rows)]
    engines = []
    for budget in budgets:
        tree = config.tree.model_copy(update={"budget": budget, "split": "best-first"})
        engine = Engine(config.model_copy(update={"tree": tree}), target, registry)
        engine.generate_batch(batch, max_new_tokens=2, batch_size=rows)  # warm-up, untimed
        engines.append(engine)
    draft: list[list[float]] = [[] for _ in budgets]
    verify: list[list[float]] = [[] for _ in budgets]
    for round_index in range(rounds):
        order = range(len(budgets)) if round_index % 2 == 0 else reversed(range(len(budgets)))
        for index in order:
            results = engines[index].generate_batch(batch, max_new_tokens=max_new_tokens, batch_size=rows)
            # each row records its step's shared times: the mean over the rows' records is the step's
            steps = [step for result in results for step in result.steps if step.rows == rows]
            if not steps:
                raise ConfigError(f"no step ran {rows} rows at once; give more max_new_tokens")
            draft[index].append(sum(step.draft_s for step in steps) / len(steps))
            verify[index].append(sum(step.verify_s for step in steps) / len(steps))
    return BatchPoint(
        rows=rows,
        budgets=list(budgets),
        draft_ms=[round(statistics.median(times) * 1e3, 4) for times in draft],
        verify_ms=[round(statistics.median(times) * 1e3, 4) for times in verify],
    )


# ---------------------------------------------------------------------- helpers
def _verify_tree(context: torch.Tensor, size: int, width: int) -> DraftTree:
    """A complete ``width``-ary tree of ``size`` nodes (parents by index arithmetic)."""
    index = torch.arange(size, device=context.device)
    parents = torch.where(index == 0, -1, (index - 1) // max(width, 1))
    tokens = context[index % context.shape[0]].clone()
    tokens[0] = context[-1]
    return DraftTree(tokens=tokens, parents=parents, scores=torch.zeros(size, device=context.device))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
