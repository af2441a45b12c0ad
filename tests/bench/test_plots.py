"""The plots: a budget axis that holds budget 0 (no drafting) next to doubling budgets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from jetflow.bench.plots import SPEEDUP_PLOT, TAU_PLOT, plot_tau_vs_budget, tau_figure, write_plots


def _run(method: str, budget: int | None, tau: float) -> dict[str, object]:
    return {"method": method, "dataset": "champ", "budget": budget, "tau": tau, "speedup_vs_ar": 1 / tau}


def test_every_budget_including_0_has_a_place_on_the_axis(tmp_path: Path) -> None:
    budgets = (0, 1, 2, 4, 8, 16, 32, 64)
    runs = [_run("ar", None, 1.0), *(_run("jetflow", b, 1 + b / 64) for b in budgets)]
    (ax,) = tau_figure(runs).axes
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == list(budgets)
    where = ax.transData.transform(np.column_stack([line.get_xdata(), line.get_ydata()]))
    box, gaps = ax.bbox, np.diff(where[:, 0])
    assert ((where[:, 0] >= box.x0) & (where[:, 0] <= box.x1)).all()
    # each budget its own place, in order: a log axis clips 0 off or squeezes the rest together
    assert (gaps > 0.05 * box.width).all()
    paths = write_plots(runs, tmp_path)
    assert [path.name for path in paths] == [TAU_PLOT, SPEEDUP_PLOT]


def test_no_drafter_run_means_no_tau_plot(tmp_path: Path) -> None:
    assert plot_tau_vs_budget([_run("ar", None, 1.0)], tmp_path / TAU_PLOT) is None
