"""``jetflow curve RUN``: a training run's held-out learning curve and where it converged;
``jetflow curve RUN RUN ...``: several runs side by side (a markdown table and one plot)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "curve",
        help="plot a training run's held-out curve and say where it converged",
        description="Read RUN/train_log.jsonl (the --out folder of `jetflow train`), write "
        "RUN/learning_curve.png and print the step and training time after which the held-out "
        "loss stays within the tolerance of its final value.",
    )
    parser.add_argument(
        "folders", type=Path, nargs="+", metavar="RUN", help="the --out folder of a `jetflow train` run"
    )
    parser.add_argument(
        "--plot",
        type=Path,
        help="several runs: where to write their comparison plot (default: comparison.png here)",
    )
    parser.add_argument(
        "--tolerance", type=float, default=None, help="relative distance to the final loss (default 0.01)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jetflow.drafters.training.curve import (
        CURVE_PLOT,
        DEFAULT_TOLERANCE,
        convergence,
        plot_curve,
        read_curve,
    )

    if len(args.folders) > 1:
        return _compare(args)
    (folder,) = args.folders
    points = read_curve(folder)
    settled = convergence(points, args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE)
    plot = plot_curve(points, folder / CURVE_PLOT, settled)
    summary = settled.as_dict() | {"plot": str(plot)}
    if args.json:
        print(json.dumps(summary))
        return 0
    for point in points:
        agreement = " ".join(f"{value:.3f}" for value in point.agreement)
        print(
            f"step {point.step:>6}  {point.train_s / 60:6.1f} min  loss {point.eval_loss:.4f}  "
            f"agreement {agreement}  chain {point.chain_accept:.3f}"
        )
    print(
        f"converged (held-out loss within {settled.tolerance:.0%} of its final {settled.final_loss:.4f}) "
        f"at step {settled.step}, {settled.train_s / 60:.1f} min of {settled.final_train_s / 60:.1f}"
    )
    print(f"plot: {plot}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    """Several runs: the table of their last evaluations and one plot of their curves."""
    from jetflow.core.errors import ConfigError
    from jetflow.drafters.training.curve import comparison_table, plot_comparison, read_curve

    names = [folder.resolve().name for folder in args.folders]
    if len(set(names)) < len(names):
        raise ConfigError(f"runs to compare need distinct folder names, got {names}")
    runs = {name: read_curve(folder) for name, folder in zip(names, args.folders, strict=True)}
    plot = plot_comparison(runs, args.plot or Path("comparison.png"))
    if args.json:
        last = {name: points[-1] for name, points in runs.items()}
        print(json.dumps({"runs": {name: vars(point) for name, point in last.items()}, "plot": str(plot)}))
        return 0
    print(comparison_table(runs), end="")
    print(f"plot: {plot}")
    return 0
