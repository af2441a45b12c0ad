"""PNG plots of a comparison: tau versus budget per drafter, speedup per data set.

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


def write_plots(runs: Sequence[dict[str, Any]], folder: Path) -> list[Path]:
    """Every plot that has data to show, written into ``folder``."""
    written = [plot_tau_vs_budget(runs, folder / TAU_PLOT), plot_speedup(runs, folder / SPEEDUP_PLOT)]
    paths = [path for path in written if path is not None]
    log.info("plots: %s", ", ".join(str(path) for path in paths))
    return paths
