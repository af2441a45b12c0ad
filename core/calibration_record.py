"""What a calibration is: the key it is valid for and the measured curves, as pydantic records.

A record is cached as JSON per machine, target, drafter (with its parameters), tree policy,
tree shape, verifier and dtype (:mod:`jetflow.core.calibration_store`); another value of any
field of :class:`CalibrationKey` means measuring again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jetflow.core.contracts import Drafter, TreePolicy, Verifier
from jetflow.core.cost_model import CHOICE_TOLERANCE
from jetflow.core.precision import cpu_model, dtype_name
from jetflow.core.target import Target
from pydantic import BaseModel, ConfigDict, Field
from torch import device as TorchDevice  # the field `torch` below shadows the module

if TYPE_CHECKING:
    from jetflow.core.config import TreeConfig

SCHEMA_VERSION = 3  # 2: the no-drafting point (budget 0); 3: T measured at every B + 1


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
    def current(cls, device: TorchDevice) -> MachineKey:
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
    #: the drafter's learned weights by content (:attr:`Drafter.weights_digest`)
    drafter_weights: str | None = None
    policy: str
    policy_params: dict[str, Any]
    width: int
    max_depth: int
    verifier: str
    verifier_params: dict[str, Any]
    #: verified through the compiled target (its latencies differ from the eager forward's)
    compiled: bool = False
    #: the target's linear weights packed once for oneDNN (:mod:`jetflow.core.packed_weights`)
    packed_weights: bool = False

    @classmethod
    def of(
        cls,
        target: Target,
        drafter: Drafter,
        policy: TreePolicy,
        verifier: Verifier,
        tree: TreeConfig,
        compiled: bool | None = None,
    ) -> CalibrationKey:
        """The key of an engine's parts (plugin parameters with their defaults filled in);
        ``compiled`` None: whether ``target`` verifies through its compiled forward now."""
        return cls(
            machine=MachineKey.current(target.device),
            target=_target_name(target.name),
            target_fingerprint=target.fingerprint(),
            dtype=dtype_name(target.dtype),
            drafter=drafter.name,
            drafter_params=drafter.params.model_dump(mode="json"),
            drafter_weights=drafter.weights_digest,
            policy=policy.name,
            policy_params=policy.params.model_dump(mode="json"),
            width=tree.width,
            max_depth=tree.max_depth,
            verifier=verifier.name,
            verifier_params=verifier.params.model_dump(mode="json"),
            compiled=target.compiled is not None if compiled is None else compiled,
            packed_weights=target.linear_weights == "packed",
        )

    def digest(self) -> str:
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def describe(self) -> str:
        """One line for messages: what was (or was not) calibrated."""
        return (
            f"drafter {self.drafter!r} (policy {self.policy}, width {self.width}, depth {self.max_depth}, "
            f"verifier {self.verifier}) on target {self.target!r} ({self.dtype}"
            f"{', compiled' if self.compiled else ''}, "
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


class BatchPoint(_Frozen):
    """What a step of ``rows`` sequences costs at each budget (the engine itself, every row's tree
    of the budget, one batched draft and one flattened verify)."""

    rows: int = Field(ge=2)
    budgets: list[int]
    draft_ms: list[float] = Field(description="mean drafting time of a step of all rows")
    verify_ms: list[float] = Field(description="mean verify, acceptance and commit of a step of all rows")

    @property
    def step_ms(self) -> list[float]:
        return [draft + verify for draft, verify in zip(self.draft_ms, self.verify_ms, strict=True)]


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
    batches: list[BatchPoint] = Field(
        default_factory=list, description="step costs measured at more rows than one (`--batch-sizes`)"
    )
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
            "batch_step_ms": {
                str(batch.rows): dict(zip(map(str, batch.budgets), batch.step_ms, strict=True))
                for batch in self.batches
            },
            "key": self.key.model_dump(mode="json"),
            "created": self.created,
            "n_prompts": self.n_prompts,
            "max_new_tokens": self.max_new_tokens,
        }


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


def _target_name(name: str) -> str:
    """A local folder or file by its absolute path, so ``./m`` and ``m`` share a calibration."""
    path = Path(name)
    return str(path.resolve()) if path.exists() else name
