"""PNG plots of a comparison: tau versus budget per drafter, speedup per data set; with a batch
axis, speedup versus batch size per method and the drafted nodes per forward versus batch size.

Drawn with matplotlib's object API on an Agg canvas, never through ``pyplot``: a library
must not switch the process-wide backend or keep figures alive in a global registry.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

log = logging.getLogger(__name__)

TAU_PLOT = "tau_vs_budget.png"
SPEEDUP_PLOT = "speedup.png"
BATCH_SPEEDUP_PLOT = "speedup_vs_batch.png"
BATCH_BUDGET_PLOT = "budget_vs_batch.png"
PEER = "hf-prompt-lookup"  # drawn as a reference line beside the drafters' tau


def _datasets(runs: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(run["dataset"] for run in runs))


def _label(run: dict[str, Any]) -> str:
    return run["method"] if run["budget"] is None else f"{run['method']} B={run['budget']}"


def _save(figure: Figure, path: Path) -> Path:
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path


def plot_tau_vs_budget(runs: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """One panel per data set, one line per drafter method; None when no drafter ran."""
    figure = tau_figure(runs)
    return None if figure is None else _save(figure, path)


def tau_figure(runs: Sequence[dict[str, Any]]) -> Figure | None:
    """The figure of :func:`plot_tau_vs_budget`, unsaved."""
    drafted = [run for run in runs if run["budget"] is not None]
    if not drafted:
        return None
    datasets = _datasets(drafted)
    figure = Figure(figsize=(4.2 * len(datasets), 3.4), layout="constrained")
    axes = figure.subplots(1, len(datasets), squeeze=False, sharey=True)[0]
    for ax, dataset in zip(axes, datasets, strict=True):
        rows = [run for run in drafted if run["dataset"] == dataset]
        for method in dict.fromkeys(run["method"] for run in rows):
            points = sorted((run["budget"], run["tau"]) for run in rows if run["method"] == method)
            ax.plot([b for b, _ in points], [t for _, t in points], marker="o", label=method)
        for peer in runs:
            if peer["dataset"] == dataset and peer["method"] == PEER:
                ax.axhline(peer["tau"], color="grey", linestyle=":", label=PEER)
        budgets = sorted({run["budget"] for run in rows})
        # budgets double; budget 0 (no drafting) needs the linear stretch of a symlog axis
        ax.set_xscale("symlog", base=2, linthresh=1) if budgets[0] == 0 else ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_title(dataset)
        ax.set_xlabel("tree budget (drafted nodes)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tau (tokens per target forward)")
    axes[-1].legend(fontsize="small")
    return figure


def plot_speedup(runs: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Grouped bars: speedup over ``ar`` of every other method, per data set."""
    others = [run for run in runs if run["method"] != "ar"]
    if not others:
        return None
    datasets = _datasets(others)
    labels = list(dict.fromkeys(_label(run) for run in others))
    width = 0.8 / len(labels)
    figure = Figure(figsize=(max(5.0, 1.2 + len(datasets) * len(labels) * 0.45), 3.6), layout="constrained")
    ax = figure.subplots()
    for offset, label in enumerate(labels):
        xs, ys = [], []
        for position, dataset in enumerate(datasets):
            match = [r for r in others if r["dataset"] == dataset and _label(r) == label]
            if match:
                xs.append(position - 0.4 + width * (offset + 0.5))
                ys.append(match[0]["speedup_vs_ar"])
        ax.bar(xs, ys, width=width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("speedup vs ar (tokens/s ratio)")
    ax.legend(fontsize="small", ncols=2)
    ax.grid(axis="y", alpha=0.3)
    return _save(figure, path)


def is_batched(runs: Sequence[dict[str, Any]]) -> bool:
    """Whether the runs are a comparison with a batch axis (``jetflow bench --batch-sizes``)."""
    return any("batch_size" in run for run in runs)


def batch_label(run: dict[str, Any]) -> str:
    """A method across batch sizes: its name, with its budget where that is fixed (an ``auto``
    run's name says so, and its budget moves)."""
    fixed = run["budget"] is not None and not run["method"].endswith("@auto")
    return f"{run['method']}@{run['budget']}" if fixed else run["method"]


def _batch_lines(
    runs: Sequence[dict[str, Any]], key: str, ylabel: str, reference: float | None
) -> Figure | None:
    """One panel per data set, batch size on a log2 axis, one line per method of ``key``'s values."""
    shown = [run for run in runs if "batch_size" in run and run.get(key) is not None]
    if not shown:
        return None
    datasets = _datasets(shown)
    figure = Figure(figsize=(4.2 * len(datasets), 3.4), layout="constrained")
    axes = figure.subplots(1, len(datasets), squeeze=False, sharey=True)[0]
    for ax, dataset in zip(axes, datasets, strict=True):
        rows = [run for run in shown if run["dataset"] == dataset]
        for label in dict.fromkeys(batch_label(run) for run in rows):
            points = sorted((run["batch_size"], run[key]) for run in rows if batch_label(run) == label)
            ax.plot([b for b, _ in points], [v for _, v in points], marker="o", label=label)
        if reference is not None:
            ax.axhline(reference, color="black", linewidth=0.8, linestyle="--")
        sizes = sorted({run["batch_size"] for run in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(size) for size in sizes])
        ax.minorticks_off()
        ax.set_title(dataset)
        ax.set_xlabel("batch size (sequences decoded at once)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(ylabel)
    axes[-1].legend(fontsize="small")
    return figure


def batch_speedup_figure(runs: Sequence[dict[str, Any]]) -> Figure | None:
    """Speedup over batched ``ar`` at each batch size, one line per other method."""
    return _batch_lines(
        [run for run in runs if run["method"] != "ar"],
        "speedup_vs_ar",
        "speedup vs ar at that batch size",
        1.0,
    )


def batch_budget_figure(runs: Sequence[dict[str, Any]]) -> Figure | None:
    """Mean nodes drafted across the batch per forward, one line per drafter method."""
    drafted = [run for run in runs if run["budget"] is not None]
    return _batch_lines(drafted, "mean_batch_budget", "mean total budget per forward (nodes)", None)


def write_batch_plots(runs: Sequence[dict[str, Any]], folder: Path) -> list[Path]:
    """The batch axis' plots that have data to show, written into ``folder``."""
    figures = [
        (batch_speedup_figure(runs), folder / BATCH_SPEEDUP_PLOT),
        (batch_budget_figure(runs), folder / BATCH_BUDGET_PLOT),
    ]
    return [_save(figure, path) for figure, path in figures if figure is not None]


def write_plots(runs: Sequence[dict[str, Any]], folder: Path) -> list[Path]:
    """Every plot that has data to show, written into ``folder``."""
    if is_batched(runs):
        paths = write_batch_plots(runs, folder)
        log.info("plots: %s", ", ".join(str(path) for path in paths))
        return paths
    written = [plot_tau_vs_budget(runs, folder / TAU_PLOT), plot_speedup(runs, folder / SPEEDUP_PLOT)]
    paths = [path for path in written if path is not None]
    log.info("plots: %s", ", ".join(str(path) for path in paths))
    return paths
