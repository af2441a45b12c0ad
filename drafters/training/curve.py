"""A run's held-out learning curve: where it converged, and a plot of it.

"How long does a head take to train" is only answered by the held-out curve: the step
(and training time) after which the held-out loss stays within a small tolerance of where
the run ended. The curve is read from the run's ``train_log.jsonl``; training time is the
cumulative ``elapsed_s`` of the log (logs of older trainers restart that clock at each resume;
such restarts are stitched back together here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jetflow.core.errors import DataError
from jetflow.drafters.training.run_log import LOG_NAME
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

CURVE_PLOT = "learning_curve.png"
#: the depths a comparison table shows (accepted lengths on a CPU tree rarely pass 4)
COMPARED_DEPTHS = 4
#: relative distance to the final held-out loss that counts as converged
DEFAULT_TOLERANCE = 0.01


@dataclass(frozen=True)
class EvalPoint:
    """One held-out evaluation: the step, cumulative training seconds and the metrics."""

    step: int
    train_s: float
    eval_loss: float
    agreement: tuple[float, ...]
    chain_accept: float


@dataclass(frozen=True)
class Convergence:
    """Where the held-out loss settled: the first evaluation from which it stays within
    ``tolerance`` (relative) of the final one."""

    step: int
    train_s: float
    final_step: int
    final_train_s: float
    final_loss: float
    tolerance: float

    def as_dict(self) -> dict[str, float | int]:
        return {
            "converged_step": self.step,
            "converged_train_s": round(self.train_s, 1),
            "final_step": self.final_step,
            "final_train_s": round(self.final_train_s, 1),
            "final_eval_loss": round(self.final_loss, 4),
            "tolerance": self.tolerance,
        }


def read_curve(run: Path) -> list[EvalPoint]:
    """The held-out evaluations of the run in folder ``run``, in step order."""
    path = Path(run) / LOG_NAME
    if not path.is_file():
        raise DataError(f"no training log at {path}: is {run} the --out folder of `jetflow train`?")
    points: list[EvalPoint] = []
    offset, last_elapsed = 0.0, 0.0
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise DataError(f"{path} line {number} is not JSON (a truncated log?)") from None
        if "elapsed_s" in record:
            if record["elapsed_s"] < last_elapsed:  # a resumed run of an older trainer restarted its clock
                offset += last_elapsed
            last_elapsed = record["elapsed_s"]
        if record.get("eval"):
            points.append(
                EvalPoint(
                    step=record["step"],
                    train_s=offset + last_elapsed,
                    eval_loss=record["eval_loss"],
                    agreement=tuple(record["agreement"]),
                    chain_accept=record["chain_accept"],
                )
            )
    if not points:
        raise DataError(f"{path} has no held-out evaluation yet")
    return points


def convergence(points: list[EvalPoint], tolerance: float = DEFAULT_TOLERANCE) -> Convergence:
    """The first evaluation after which every held-out loss is within ``tolerance`` of the last."""
    final = points[-1]
    settled = final
    for point in reversed(points):
        if abs(point.eval_loss - final.eval_loss) > tolerance * final.eval_loss:
            break
        settled = point
    return Convergence(settled.step, settled.train_s, final.step, final.train_s, final.eval_loss, tolerance)


def plot_curve(points: list[EvalPoint], path: Path, settled: Convergence | None = None) -> Path:
    """Held-out loss and per-depth agreement against training time (minutes)."""
    minutes = [point.train_s / 60 for point in points]
    figure = Figure(figsize=(9.0, 3.4), layout="constrained")
    loss_ax, agree_ax = figure.subplots(1, 2)
    loss_ax.plot(minutes, [point.eval_loss for point in points], marker="o")
    loss_ax.set_ylabel("held-out loss")
    for depth in range(len(points[0].agreement)):
        agree_ax.plot(minutes, [point.agreement[depth] for point in points], label=f"depth {depth + 1}")
    agree_ax.plot(
        minutes, [point.chain_accept for point in points], color="black", linestyle="--", label="chain"
    )
    agree_ax.set_ylabel("held-out top-1 agreement")
    agree_ax.legend(fontsize="x-small", ncols=2)
    for ax in (loss_ax, agree_ax):
        ax.set_xlabel("training time (minutes)")
        ax.grid(alpha=0.3)
        if settled is not None:
            ax.axvline(settled.train_s / 60, color="grey", linestyle=":")
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path


def comparison_table(runs: dict[str, list[EvalPoint]], depths: int = COMPARED_DEPTHS) -> str:
    """A markdown table of each run's last held-out evaluation: loss, agreement per depth, chain.

    Comparable only between runs evaluated on the same held-out data (an ``eval_corpus``).
    """
    header = ["run", "steps", "train min", "held-out loss", *(f"d{d + 1}" for d in range(depths)), "chain"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for name, points in runs.items():
        last = points[-1]
        agreement = [f"{a:.3f}" if a is not None else "-" for a in last.agreement[:depths]]
        agreement += ["-"] * (depths - len(agreement))
        cells = [name, str(last.step), f"{last.train_s / 60:.1f}", f"{last.eval_loss:.4f}", *agreement]
        lines.append("| " + " | ".join([*cells, f"{last.chain_accept:.3f}"]) + " |")
    return "\n".join(lines) + "\n"


def plot_comparison(runs: dict[str, list[EvalPoint]], path: Path) -> Path:
    """Held-out loss and depth-1 agreement of several runs against the optimiser step."""
    figure = Figure(figsize=(9.0, 3.4), layout="constrained")
    loss_ax, agree_ax = figure.subplots(1, 2)
    for name, points in runs.items():
        steps = [point.step for point in points]
        loss_ax.plot(steps, [point.eval_loss for point in points], marker=".", label=name)
        agree_ax.plot(steps, [point.agreement[0] for point in points], marker=".", label=name)
    loss_ax.set_ylabel("held-out loss")
    agree_ax.set_ylabel("held-out depth-1 agreement")
    agree_ax.legend(fontsize="x-small")
    for ax in (loss_ax, agree_ax):
        ax.set_xlabel("optimiser step")
        ax.grid(alpha=0.3)
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path
