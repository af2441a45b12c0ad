"""``jetflow calibrate``: measure this machine's step costs and acceptance, choose the tree budget.

The result is cached per machine, target, drafter, policy and dtype; afterwards ``--budget
auto`` (and ``generate`` without ``--budget``) uses the chosen budget. A cached calibration
is shown again instead of re-measured unless ``--force`` is given.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from jetflow.cli._options import add_compile_flag
from jetflow.core.config import GenerateConfig, build_config, load_toml, merge
from jetflow.core.errors import ConfigError

if TYPE_CHECKING:
    from jetflow.core.calibration import Calibration


def parse_budgets(text: str) -> list[int]:
    """``1,2,4`` into integers >= 1; anything else is a one-line :class:`ConfigError`."""
    try:
        budgets = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        budgets = []
    if not budgets or min(budgets) < 1:
        raise ConfigError(f"--budgets must be a comma list of integers >= 1, got {text!r}")
    return budgets


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure verify latency, drafting cost and acceptance here; choose the tree budget",
        description="Measure the target's verify latency per tree size, the drafter's cost and the "
        "acceptance curve tau(budget) on a few calibration prompts; cache the result and print the "
        "budget that maximises expected tokens per second.",
    )
    parser.add_argument("--config", help="TOML file with GenerateConfig fields; flags override it")
    parser.add_argument("--target", help="'default', a local folder, a .gguf file or a cached hub id")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument(
        "--drafter",
        help="drafter plugin name (default: the config's, else jetflow if shipped, else ngram)",
    )
    parser.add_argument("--tree-policy", help="tree policy plugin name (default: the drafter's)")
    parser.add_argument("--width", type=int, help="children proposed per expanded node")
    parser.add_argument("--max-depth", type=int, help="deepest tree level")
    parser.add_argument("--budgets", help="comma list of budgets to measure (default 1,2,4,...,256)")
    parser.add_argument("--prompts", type=int, default=4, help="calibration prompts to run (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per prompt and budget (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed verify forwards per tree size")
    parser.add_argument("--threads", type=int, help="torch CPU threads (part of the calibration's key)")
    parser.add_argument(
        "--batch-sizes",
        help="comma list of batch sizes (> 1) whose step costs to measure too, e.g. 4,8,16: "
        "a batch's budget is then priced from them",
    )
    add_compile_flag(parser)
    parser.add_argument(
        "--all-budgets", action="store_true", help="measure every budget, even past the peak speed"
    )
    parser.add_argument("--force", action="store_true", help="measure again even if a calibration is cached")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def config_from_args(args: argparse.Namespace) -> GenerateConfig:
    base = load_toml(args.config) if args.config else {}
    tree = {"policy": args.tree_policy, "width": args.width, "max_depth": args.max_depth}
    flags: dict[str, Any] = {
        "target": args.target,
        "dtype": args.dtype,
        "drafter": args.drafter,
        "compile": args.compile,
    }
    overrides = {key: value for key, value in flags.items() if value is not None}
    tree = {key: value for key, value in tree.items() if value is not None}
    if tree:
        overrides["tree"] = tree
    config = build_config(GenerateConfig, merge(base, overrides))
    config = config.model_copy(update={"compile": bool(config.compile)})  # measured: eager unless asked
    if not config.uses_drafter:
        raise ConfigError("calibrate needs a drafter: without one there is no budget to choose")
    return config


def run(args: argparse.Namespace) -> int:
    import torch
    from jetflow.core import calibration as cal
    from jetflow.core.precision import resolve_dtype
    from jetflow.core.target import Target

    if not 1 <= args.prompts <= len(cal.CALIBRATION_PROMPTS):
        raise ConfigError(
            f"--prompts must be between 1 and {len(cal.CALIBRATION_PROMPTS)}, got {args.prompts}"
        )
    for name in ("max_new_tokens", "repeats", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    budgets = parse_budgets(args.budgets) if args.budgets else cal.DEFAULT_BUDGETS
    batch_sizes = parse_batch_sizes(args.batch_sizes) if args.batch_sizes else []
    config = config_from_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target = Target.load(config.target, resolve_dtype(config.dtype))
    config = config.with_available_drafter(target)
    key = cal.key_for(config, target)

    calibration = None
    if not args.force:
        try:
            calibration = cal.load_calibration(key)
        except ConfigError as error:
            print(f"jetflow: measuring again: {error}", file=sys.stderr)
    cached = calibration is not None
    if calibration is None:
        calibration = cal.calibrate(
            config,
            target,
            prompts=cal.CALIBRATION_PROMPTS[: args.prompts],
            budgets=budgets,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
            progress=not args.json,
            early_stop=not args.all_budgets,
            batch_sizes=batch_sizes,
        )
        cal.save_calibration(calibration)
    elif batch_sizes:
        measured = cal.with_batches(
            calibration, config, target, batch_sizes, cal.CALIBRATION_PROMPTS[: args.prompts]
        )
        if measured is not calibration:
            calibration = measured
            cal.save_calibration(calibration)
    path = cal.calibration_path(key)

    if args.json:
        print(json.dumps({**calibration.summary(), "cached": cached, "path": str(path)}))
        return 0
    _print_table(calibration)
    when = f"cached from {calibration.created}; --force measures again" if cached else "saved"
    print(f"{when}: {path}")
    return 0


def parse_batch_sizes(text: str) -> list[int]:
    """``4,8,16`` -> ``[4, 8, 16]``; a clear error for anything but integers >= 2."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--batch-sizes takes a comma list of integers, got {text!r}") from None
    if not sizes or min(sizes) < 2:
        raise ConfigError(f"--batch-sizes are batch sizes >= 2 (1 is always measured), got {text!r}")
    return sorted(set(sizes))


def _print_table(calibration: Calibration) -> None:
    print(f"calibration of {calibration.key.describe()}")
    print(f"{'budget':>7} {'tau':>6} {'draft ms':>9} {'verify ms':>10} {'nodes':>7} {'tokens/s':>9}")
    for point in calibration.points:
        mark = " *" if point.budget == calibration.budget else ""
        print(
            f"{point.budget:>7} {point.tau:>6.2f} {point.draft_ms:>9.2f} {point.verify_ms:>10.2f} "
            f"{point.mean_tree_size:>7.1f} {point.expected_tokens_per_s:>9.1f}{mark}"
        )
    if calibration.skipped_budgets:
        skipped = ", ".join(map(str, calibration.skipped_budgets))
        print(f"not measured: {skipped} (past the peak; --all-budgets measures them)")
    one_node = calibration.verify_latency_ms[0]
    print(f"no drafter: {one_node:.1f} ms per token -> {calibration.baseline_tokens_per_s:.1f} tokens/s")
    latency = ", ".join(
        f"{n}: {ms:.0f}" for n, ms in zip(calibration.tree_sizes, calibration.verify_latency_ms, strict=True)
    )
    print(f"verify latency ms by tree size (batch {calibration.batch_size}): {latency}")
    for batch in calibration.batches:
        costs = ", ".join(f"{b}: {ms:.0f}" for b, ms in zip(batch.budgets, batch.step_ms, strict=True))
        print(f"step ms of {batch.rows} rows by budget: {costs}")
    print(f"chosen: {calibration.reason()}")
    print(
        "generation starts there and re-chooses among the budgets above every step, from the "
        "acceptance it sees (--no-adapt keeps it)"
    )
