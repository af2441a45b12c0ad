"""The cost model: measure what a step costs here, model tokens per second, pick the budget.

The budget that pays off depends on the hardware and the load (REFERENCE.md: 128-256 nodes
on an H100, far fewer on a 2-core CPU), so it is measured rather than fixed:

* ``T(n)``: the target's verify latency for a tree of ``n`` nodes (the real
  :meth:`Target.verify`, acceptance and commit on real trees; medians after warm-up),
  measured at every candidate's own tree size ``B + 1`` and on a grid between them.
  Interpolation alone misleads: on the 2-core CPU this was written on, a calibration measured
  ``T(2)`` 91 ms and ``T(4)`` 130 ms and charged budget 2 the line between them, 110 ms, while
  its steps in the benchmark verified 3 nodes in 85 ms (the matrix kernels' blocking makes
  ``T`` a staircase), and budget 2 was then the fastest fixed budget. Batch size is 1: the
  engine decodes one sequence at a time.
* ``tau(B)`` and the draft cost per step at budget ``B``: the engine itself on a few
  calibration prompts (never benchmark prompts), with draft time = ``drafter.begin`` plus
  the policy's build, exactly as the loop spends it.
* expected tokens/s ``= tau(B) / (draft(B) + verify(B))`` where ``verify(B)`` averages
  ``T`` over the trees actually built at ``B``. That is ``T(B + 1)`` when the drafter fills
  its budget; a prompt-lookup drafter often cannot, and charging it for nodes it never
  drafted would bias the choice against large budgets.

Budgets are measured smallest first and the search stops once the expected speed has
clearly peaked, so a CPU never spends minutes on 256-node trees it would not choose.
The result is cached as JSON per machine, target, drafter (with its parameters), tree
policy, tree shape, verifier and dtype under ``cache_root()/calibration``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from jetflow.core.config import DEFAULT_BUDGET, GenerateConfig
from jetflow.core.contracts import Drafter, TreePolicy, Verifier
from jetflow.core.errors import ConfigError
from jetflow.core.precision import cpu_model, dtype_name
from jetflow.core.target import DEFAULT_TARGET, Target, cache_root
from jetflow.core.tree import DraftTree
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from jetflow.core.config import TreeConfig
    from jetflow.core.engine import Engine, Prompt
    from jetflow.core.registry import Registry

log = logging.getLogger(__name__)

SCHEMA_VERSION = 3  # 2: the no-drafting point (budget 0); 3: T measured at every B + 1
#: predictions within this relative distance of the best count as equal; the smaller budget wins.
#: Repeated calibrations of one setup on this 2-core machine, under load, moved the expected speed
#: of budgets 0-2 by 3-7% from run to run, while the ranking of clearly different budgets held.
CHOICE_TOLERANCE = 0.05
#: budgets whose acceptance is measured (each one an engine run per prompt)
DEFAULT_BUDGETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: calibration stops growing the budget once two in a row fall below this share of the best
EARLY_STOP_FRACTION = 0.8
#: tree sizes (root included) whose verify latency is measured; others are interpolated
DEFAULT_TREE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)

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


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MachineKey(_Frozen):
    """What a latency depends on besides the model: processor or GPU, threads, torch build."""

    cpu: str
    device: str
    accelerator: str | None
    torch_threads: int
    torch: str

    @classmethod
    def current(cls, device: torch.device) -> MachineKey:
        accelerator = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        return cls(
            cpu=cpu_model(),
            device=device.type,
            accelerator=accelerator,
            torch_threads=torch.get_num_threads(),
            torch=torch.__version__,
        )


class CalibrationKey(_Frozen):
    """Everything a calibration is valid for; another value of any field means measuring again."""

    machine: MachineKey
    target: str
    target_fingerprint: dict[str, Any]
    dtype: str
    drafter: str
    drafter_params: dict[str, Any]
    policy: str
    policy_params: dict[str, Any]
    width: int
    max_depth: int
    verifier: str
    verifier_params: dict[str, Any]

    @classmethod
    def of(
        cls, target: Target, drafter: Drafter, policy: TreePolicy, verifier: Verifier, tree: TreeConfig
    ) -> CalibrationKey:
        """The key of an engine's parts (plugin parameters with their defaults filled in)."""
        return cls(
            machine=MachineKey.current(target.device),
            target=_target_name(target.name),
            target_fingerprint=target.fingerprint(),
            dtype=dtype_name(target.dtype),
            drafter=drafter.name,
            drafter_params=drafter.params.model_dump(mode="json"),
            policy=policy.name,
            policy_params=policy.params.model_dump(mode="json"),
            width=tree.width,
            max_depth=tree.max_depth,
            verifier=verifier.name,
            verifier_params=verifier.params.model_dump(mode="json"),
        )

    def digest(self) -> str:
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def describe(self) -> str:
        """One line for messages: what was (or was not) calibrated."""
        return (
            f"drafter {self.drafter!r} (policy {self.policy}, width {self.width}, depth {self.max_depth}, "
            f"verifier {self.verifier}) on target {self.target!r} ({self.dtype}, "
            f"{self.machine.torch_threads} torch threads, {self.machine.accelerator or self.machine.cpu})"
        )


class BudgetPoint(_Frozen):
    """The measured curves and the model's prediction at one budget."""

    budget: int
    tau: float = Field(description="tokens emitted per verify step")
    draft_ms: float = Field(description="mean drafting time per step")
    verify_ms: float = Field(description="mean modelled verify latency per step, T at the trees built")
    mean_tree_size: float = Field(description="nodes verified per step, root included")
    expected_tokens_per_s: float


class Calibration(_Frozen):
    """One cached calibration: the key, the measured curves and the chosen budget."""

    version: int = SCHEMA_VERSION
    key: CalibrationKey
    created: str
    batch_size: int = 1
    tree_sizes: list[int]
    verify_latency_ms: list[float]
    points: list[BudgetPoint]
    skipped_budgets: list[int] = Field(default_factory=list, description="not measured: past the peak")
    budget: int
    baseline_tokens_per_s: float = Field(description="1 / T(1): the loop without a drafter")
    n_prompts: int
    max_new_tokens: int
    repeats: int

    @property
    def expected_tokens_per_s(self) -> dict[str, float]:
        return {str(point.budget): point.expected_tokens_per_s for point in self.points}

    @property
    def chosen(self) -> BudgetPoint:
        return next(point for point in self.points if point.budget == self.budget)

    def reason(self) -> str:
        """Why this budget, in one line."""
        chosen, base = self.chosen, self.baseline_tokens_per_s
        best = max(self.points, key=lambda p: (p.expected_tokens_per_s, -p.budget))
        if chosen.budget == 0:
            line = f"budget 0 (no drafting): {chosen.expected_tokens_per_s:.1f} expected tokens/s"
        else:
            line = (
                f"budget {chosen.budget}: {chosen.expected_tokens_per_s:.1f} expected tokens/s (tau "
                f"{chosen.tau:.2f} per {chosen.draft_ms:.1f} ms draft + {chosen.verify_ms:.1f} ms verify), "
                f"{chosen.expected_tokens_per_s / base:.2f}x the no-drafter loop"
            )
        if best.budget == chosen.budget:
            others = [p for p in self.points if p.budget != chosen.budget]
            if others:
                second = max(others, key=lambda p: p.expected_tokens_per_s)
                line += (
                    f"; the most of all (next: budget {second.budget} at {second.expected_tokens_per_s:.1f})"
                )
        else:
            line += (
                f"; budget {best.budget} predicts {best.expected_tokens_per_s:.1f}, within the model's "
                f"{CHOICE_TOLERANCE:.0%} error, so the smaller budget is taken"
            )
        return line

    def summary(self) -> dict[str, Any]:
        """What ``jetflow calibrate --json`` prints: the choice first, then the curves."""
        by_budget = {str(p.budget): p for p in self.points}
        return {
            "budget": self.budget,
            "expected_tokens_per_s": self.expected_tokens_per_s,
            "reason": self.reason(),
            "baseline_tokens_per_s": self.baseline_tokens_per_s,
            "tau": {b: p.tau for b, p in by_budget.items()},
            "draft_ms": {b: p.draft_ms for b, p in by_budget.items()},
            "verify_ms": {b: p.verify_ms for b, p in by_budget.items()},
            "mean_tree_size": {b: p.mean_tree_size for b, p in by_budget.items()},
            "verify_latency_ms": dict(zip(map(str, self.tree_sizes), self.verify_latency_ms, strict=True)),
            "skipped_budgets": self.skipped_budgets,
            "batch_size": self.batch_size,
            "key": self.key.model_dump(mode="json"),
            "created": self.created,
            "n_prompts": self.n_prompts,
            "max_new_tokens": self.max_new_tokens,
        }


# ---------------------------------------------------------------------- the model (pure)
def expected_tokens_per_s(
    tau: Sequence[float], draft_s: Sequence[float], verify_s: Sequence[float]
) -> np.ndarray:
    """``tau / (draft + verify)`` per budget: tokens emitted per second of one decoding step."""
    cost = np.asarray(draft_s, dtype=float) + np.asarray(verify_s, dtype=float)
    return np.asarray(tau, dtype=float) / np.maximum(cost, 1e-12)


def choose_budget(budgets: Sequence[int], tokens_per_s: Sequence[float], tolerance: float = 0.0) -> int:
    """The smallest budget whose expected tokens/s is within ``tolerance`` (relative) of the best.

    With ``tolerance`` 0 that is the argmax, the smaller budget on a tie. A calibration passes
    :data:`CHOICE_TOLERANCE`: predictions that close are within the model's error on a loaded
    machine, and the smaller tree is then the safer bet (less memory, less drafter work, and
    at 0 no drafting at all).
    """
    if len(budgets) == 0 or len(budgets) != len(tokens_per_s):
        raise ValueError("choose_budget needs one expected speed per budget")
    order = np.argsort(np.asarray(budgets), kind="stable")
    speeds = np.asarray(tokens_per_s, dtype=float)[order]
    good_enough = speeds >= (1.0 - tolerance) * speeds.max()
    return int(np.asarray(budgets)[order][int(np.argmax(good_enough))])


def interpolate_latency(sizes: Sequence[int], latency_s: Sequence[float], at: Sequence[int]) -> np.ndarray:
    """``T`` at tree sizes ``at``, piecewise linear between measured sizes (clamped at the ends)."""
    return np.interp(np.asarray(at, dtype=float), np.asarray(sizes, dtype=float), np.asarray(latency_s))


# ---------------------------------------------------------------------- the cache
def calibration_path(key: CalibrationKey) -> Path:
    return cache_root() / "calibration" / f"{key.digest()}.json"


def load_calibration(key: CalibrationKey) -> Calibration | None:
    """The cached calibration for ``key``; None if there is none.

    Raises :class:`ConfigError` (one line) if the file exists but cannot be used: a stale
    schema, a record for another key, or a corrupt file.
    """
    path = calibration_path(key)
    if not path.is_file():
        return None
    rerun = f"rerun `jetflow calibrate --force` ({path})"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"the cached calibration is unreadable ({type(error).__name__}); {rerun}") from None
    if not isinstance(data, dict) or data.get("version") != SCHEMA_VERSION:
        found = data.get("version") if isinstance(data, dict) else None
        raise ConfigError(
            f"the cached calibration has schema version {found!r}, not {SCHEMA_VERSION}; {rerun}"
        )
    try:
        calibration = Calibration.model_validate(data)
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        message = f"the cached calibration is invalid at {where}: {problem['msg']}"
        raise ConfigError(f"{message}; {rerun}") from None
    if calibration.key != key:
        raise ConfigError(f"the cached calibration was measured for another setup; {rerun}")
    return calibration


def save_calibration(calibration: Calibration) -> Path:
    """Write atomically, so a concurrent reader sees the old file or the new one, never half."""
    path = calibration_path(calibration.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f"{path.name}.tmp{os.getpid()}")
    staging.write_text(calibration.model_dump_json(indent=1), encoding="utf-8")
    staging.replace(path)
    return path


#: "adaptive": calibrated, then re-chosen every step (:mod:`jetflow.core.adaptive`)
BudgetSource = Literal["fixed", "calibrated", "adaptive", "default"]


def resolve_budget(
    requested: int | str | None, key: CalibrationKey, target_spec: str = DEFAULT_TARGET
) -> tuple[int, BudgetSource, Calibration | None]:
    """The budget an engine starts with, where it came from, and the calibration behind it.

    A fixed budget is taken as given; ``auto`` or unset come from the cached calibration.
    Unset falls back to :data:`DEFAULT_BUDGET` when nothing (usable) is cached, so a first
    run never stops to measure; ``auto`` is an explicit request and fails with what to run
    (``target_spec`` is the target as the user named it, for that command).
    """
    if isinstance(requested, int):
        return requested, "fixed", None
    try:
        calibration = load_calibration(key)
    except ConfigError as error:
        if requested == "auto":
            raise
        log.warning("ignoring the cached calibration: %s", error)
        calibration = None
    if calibration is not None:
        log.info("budget %d from calibration: %s", calibration.budget, calibration.reason())
        return calibration.budget, "calibrated", calibration
    if requested == "auto":
        raise ConfigError(
            f"--budget auto needs a calibration and there is none for {key.describe()}; "
            f"run `{calibrate_command(key, target_spec)}` first (or pass a fixed --budget)"
        )
    return DEFAULT_BUDGET, "default", None


def calibrate_command(key: CalibrationKey, target_spec: str = DEFAULT_TARGET) -> str:
    """The command that measures ``key`` (for the message when it is missing)."""
    words = ["jetflow", "calibrate", "--drafter", key.drafter, "--tree-policy", key.policy]
    if target_spec != DEFAULT_TARGET:
        words += ["--target", target_spec]
    words += ["--dtype", key.dtype, "--threads", str(key.machine.torch_threads)]
    return shlex.join(words)


# ---------------------------------------------------------------------- measurement
def engine_at(
    config: GenerateConfig, target: Target, budget: int, registry: Registry | None = None
) -> Engine:
    """An engine for ``config`` at a fixed ``budget`` (so it never looks for a calibration)."""
    from jetflow.core.engine import Engine  # the engine resolves its budget through this module

    tree = config.tree.model_copy(update={"budget": budget})
    return Engine(config.model_copy(update={"tree": tree}), target, registry)


def key_for(config: GenerateConfig, target: Target, registry: Registry | None = None) -> CalibrationKey:
    """The key under which ``config`` on ``target`` is calibrated (plugins built, nothing run)."""
    if not config.uses_drafter:
        raise ConfigError("calibration needs a drafter (the budget of plain decoding is always 0)")
    engine = engine_at(config, target, 1, registry)
    return CalibrationKey.of(target, engine.drafter, engine.policy, engine.verifier, config.tree)


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
    The medians are used as measured, not forced to grow with the size: on the 2-core CPU
    this was written on, a 17-node verify took 129 ms and a 9-node one 181 ms (the matrix
    kernels' blocking), and the benchmark agreed (budget 16 ran faster than 8 on all three
    data sets at nearly the same tau). ``on_measure`` is called after every forward.
    """
    context = torch.tensor(list(context_ids), dtype=torch.long)
    cache, _ = target.prefill(context[:-1])
    n_cached = cache.get_seq_length()
    generator = torch.Generator().manual_seed(0)
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
) -> Calibration:
    """Measure ``T(n)``, ``tau(B)`` and the draft cost, and choose the budget (not saved).

    ``config`` names the drafter, policy, tree shape and verifier; its budget is ignored.
    ``tree_sizes`` defaults to the grid up to ``max(budgets) + 1``; every ``B + 1`` is always
    measured too.
    With ``early_stop``, budgets after the expected speed has clearly peaked are skipped
    (see :func:`_past_the_peak`): on a CPU they are the slowest to measure and never win.
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
    key = CalibrationKey.of(target, first.drafter, first.policy, first.verifier, config.tree)
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
            layers=first.drafter.feature_layers,
            on_measure=bar.update,
        )
        points: list[BudgetPoint] = []
        skipped: list[int] = []
        for budget in budgets:
            if early_stop and _past_the_peak(points):
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
    return Calibration(
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


def no_drafting_point(single_step_s: float) -> BudgetPoint:
    """Budget 0: one token per verify of the root alone, nothing drafted (plain decoding)."""
    return BudgetPoint(
        budget=0,
        tau=1.0,
        draft_ms=0.0,
        verify_ms=round(single_step_s * 1e3, 4),
        mean_tree_size=1.0,
        expected_tokens_per_s=round(1.0 / single_step_s, 3),
    )


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


def _past_the_peak(points: Sequence[BudgetPoint]) -> bool:
    """Two budgets in a row below :data:`EARLY_STOP_FRACTION` of the best: stop growing.

    tau saturates with the budget while the verify cost keeps growing, so once the expected
    speed has clearly turned down, larger (and the most expensive to measure) budgets lose.
    """
    if len(points) < 3:
        return False
    best = max(point.expected_tokens_per_s for point in points)
    return all(p.expected_tokens_per_s < EARLY_STOP_FRACTION * best for p in points[-2:])


# ---------------------------------------------------------------------- helpers
def _verify_tree(context: torch.Tensor, size: int, width: int) -> DraftTree:
    """A complete ``width``-ary tree of ``size`` nodes (parents by index arithmetic)."""
    index = torch.arange(size)
    parents = torch.where(index == 0, -1, (index - 1) // max(width, 1))
    tokens = context[index % context.shape[0]].clone()
    tokens[0] = context[-1]
    return DraftTree(tokens=tokens, parents=parents, scores=torch.zeros(size))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _target_name(name: str) -> str:
    """A local folder or file by its absolute path, so ``./m`` and ``m`` share a calibration."""
    path = Path(name)
    return str(path.resolve()) if path.exists() else name
