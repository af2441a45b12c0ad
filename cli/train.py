"""``jetflow train``: train a drafter's head on a corpus's target features, cached or (``--online``)
computed by the target inside the loop.

The command reads its arguments into a :class:`TrainConfig` and calls
:func:`jetflow.drafters.training.train`, which does the work. Data-parallel with
``torchrun --nproc-per-node N $(which jetflow) train ...``: every process trains on its share
of each step's global batch (``batch_sequences``); the first one logs, evaluates, writes the
checkpoints and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jetflow.core.config import merge
from jetflow.core.errors import ConfigError

if TYPE_CHECKING:
    from jetflow.drafters.training import TrainConfig, TrainResult


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="train a learned drafter head with the shared trainer")
    parser.add_argument("--drafter", required=True, help="drafter plugin whose head to train (e.g. jetflow)")
    parser.add_argument(
        "--config", type=Path, help="train config TOML (default: the drafter's shipped recipe)"
    )
    parser.add_argument(
        "--corpus",
        type=Path,
        action="append",
        help="corpus folder, repeatable (default: the default target's first and second turns)",
    )
    parser.add_argument(
        "--target", help="target spec, as for `jetflow generate` (default: the recipe's, 'default')"
    )
    parser.add_argument("--features", type=Path, help="feature cache folder (default: the corpus's cache)")
    parser.add_argument(
        "--online",
        action="store_true",
        default=None,
        help="run the target inside the loop for each step's features: no feature cache is read or written",
    )
    parser.add_argument("--out", type=Path, help="output folder (log, checkpoints, final head)")
    parser.add_argument("--steps", type=int, help="override the number of optimiser steps")
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help='override one config value, dotted keys and TOML values (e.g. loss.kind="sft"); repeatable',
    )
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    parser.add_argument(
        "--warm-start",
        type=Path,
        help="continue from this head checkpoint's weights and step with a fresh optimiser (where "
        "the resumable state is gone); --resume wins where --out holds a checkpoint",
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (1 is fastest on a busy machine)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jetflow.drafters.training import train

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    config = build_train_config(args)
    result = train(config, resume=args.resume)
    if not result.main_process:
        return 0
    summary = summarise(config.drafter, result)
    print(json.dumps(summary) if args.json else "\n".join(f"{k:<16} {v}" for k, v in summary.items()))
    return 0


def build_train_config(args: argparse.Namespace) -> TrainConfig:
    """The run's config: the recipe (``--config``, else the drafter's shipped one) under the flags."""
    from jetflow.drafters.training import TrainConfig
    from jetflow.drafters.training.run import shipped_recipe

    return TrainConfig.from_toml(
        args.config or shipped_recipe(args.drafter),
        settings=parse_settings(args.settings),
        drafter=args.drafter,
        target=args.target,
        online=args.online,
        out=str(args.out) if args.out else None,
        corpus=[str(c) for c in args.corpus] if args.corpus else None,
        features=str(args.features) if args.features else None,
        steps=args.steps,
        warm_start=str(args.warm_start) if args.warm_start else None,
    )


def summarise(drafter: str, result: TrainResult) -> dict[str, Any]:
    """The printed summary: the run's figures, its last evaluation and where its curve settled."""
    settled = result.convergence.as_dict() if result.convergence else {}
    return {
        "drafter": drafter,
        "steps": result.steps,
        "wall_s": round(result.wall_s, 1),
        "train_s": round(result.train_s, 1),
        "positions_per_s": round(result.positions_per_s, 1),
        "checkpoint": str(result.final_checkpoint),
        **result.evaluation,
        **settled,
    }


def parse_settings(settings: list[str]) -> dict[str, Any]:
    """``["loss.kind=\"sft\"", "steps=300"]`` -> nested dict; values are TOML (bare words are strings)."""
    nested: dict[str, Any] = {}
    for setting in settings:
        key, sep, raw = setting.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects KEY=VALUE, got {setting!r}")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        for part in reversed(key.strip().split(".")):
            value = {part: value}
        nested = merge(nested, value)
    return nested
