"""``jetflow train``: train a drafter's head on the cached target features of a corpus.

Data-parallel with ``torchrun --nproc-per-node N $(which jetflow) train ...``: every process
trains on its share of each step's global batch (``batch_sequences``); the first one logs,
evaluates, writes the checkpoints and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from jetflow.core.config import merge
from jetflow.core.errors import ConfigError, DataError

if TYPE_CHECKING:
    from jetflow.drafters.training.trainer import TrainConfig


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
    parser.add_argument("--features", type=Path, help="feature cache folder (default: the corpus's cache)")
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
    from jetflow.core.precision import resolve_dtype
    from jetflow.core.registry import default_registry
    from jetflow.core.target import Target
    from jetflow.drafters.blocks import FrozenTargetParts
    from jetflow.drafters.checkpoint import CheckpointInfo, target_record
    from jetflow.drafters.training.curve import CURVE_PLOT, convergence, plot_curve, read_curve
    from jetflow.drafters.training.distributed import DataParallel
    from jetflow.drafters.training.trainer import TrainConfig, Trainer

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    drafter_cls = default_registry().get("drafter", args.drafter)
    if not hasattr(drafter_cls, "new_head"):
        raise ConfigError(f"drafter {args.drafter!r} has no trainable head")
    config_path = args.config or _shipped_config(drafter_cls)
    config = TrainConfig.from_toml(
        config_path,
        settings=parse_settings(args.settings),
        drafter=args.drafter,
        out=str(args.out) if args.out else None,
        corpus=[str(c) for c in args.corpus] if args.corpus else None,
        features=str(args.features) if args.features else None,
        steps=args.steps,
        warm_start=str(args.warm_start) if args.warm_start else None,
    )
    target = Target.load(config.target, dtype=resolve_dtype("float32"))
    head = drafter_cls.new_head(target, config.head)
    layers = tuple(head.config.feature_layers)
    config = _with_resolved_corpora(config)  # the head's recipe records the data it saw
    store = _open_store(config.corpus, config.features, layers, target, limit=config.max_sequences)
    eval_corpus = config.eval_corpus
    eval_store = _open_store([eval_corpus], None, layers, target, purpose="eval") if eval_corpus else None
    info = CheckpointInfo(
        drafter=args.drafter,
        architecture=head.config.model_dump(mode="json"),
        target=target_record(target, layers),
    )
    parallel = DataParallel.from_env(target.device)  # under torchrun: one process of several
    shared = FrozenTargetParts.from_target(target)
    trainer = Trainer(config, head, shared, store, info, parallel=parallel, eval_store=eval_store)
    result = trainer.fit(resume=args.resume, target=target)
    parallel.close()
    if not parallel.is_main:
        return 0
    folder = result.final_checkpoint.parent
    points = read_curve(folder)
    settled = convergence(points)
    plot_curve(points, folder / CURVE_PLOT, settled)
    summary = {
        "drafter": args.drafter,
        "steps": result.steps,
        "wall_s": round(result.wall_s, 1),
        "train_s": round(result.train_s, 1),
        "positions_per_s": round(result.positions_per_s, 1),
        "checkpoint": str(result.final_checkpoint),
        **result.evaluation,
        **settled.as_dict(),
    }
    print(json.dumps(summary) if args.json else "\n".join(f"{k:<16} {v}" for k, v in summary.items()))
    return 0


def parse_settings(settings: list[str]) -> dict:
    """``["loss.kind=\"sft\"", "steps=300"]`` -> nested dict; values are TOML (bare words are strings)."""
    nested: dict = {}
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


def _shipped_config(drafter_cls) -> Path:
    path = drafter_cls.default_train_config() if hasattr(drafter_cls, "default_train_config") else None
    if path is None or not Path(path).is_file():
        raise ConfigError(f"drafter {drafter_cls.name!r} ships no train config: pass --config FILE")
    return Path(path)


def _with_resolved_corpora(config: TrainConfig) -> TrainConfig:
    """``config`` with its default corpora spelled out: the training corpora (the default
    target's first and second turns) and the held-out sibling of the first, where it exists."""
    from jetflow.drafters.training.corpus import default_eval_corpus_dir, training_corpus_dirs

    corpora = [Path(c) for c in config.corpus] if config.corpus else training_corpus_dirs()
    eval_corpus = Path(config.eval_corpus) if config.eval_corpus else default_eval_corpus_dir(corpora[0])
    return config.model_copy(
        update={
            "corpus": [_as_recorded(c) for c in corpora],
            "eval_corpus": _as_recorded(eval_corpus) if eval_corpus else None,
        }
    )


def _as_recorded(folder: Path) -> str:
    """``folder`` relative to the working directory where it lies below it (a checkout's
    corpora then read the same on every machine), else as it is."""
    absolute, here = Path(folder).resolve(), Path.cwd()
    return str(absolute.relative_to(here)) if absolute.is_relative_to(here) else str(folder)


def _open_store(
    corpus_dirs: list[str],
    features_dir: str | None,
    layers: tuple[int, ...],
    target,
    purpose: Literal["train", "eval"] = "train",
    limit: int | None = None,
):
    """The feature caches of the corpora for ``layers`` (one store), checked against ``target``.

    A corpus regenerated from a benchmark set (the held-out split) is refused for training.
    With ``limit``, only the first ``limit`` sequences are read (corpora past them are not
    opened), so only their features need to exist.
    """
    from jetflow.data.prompt_sets import BENCHMARK_NAMES
    from jetflow.drafters.training.corpus import Corpus
    from jetflow.drafters.training.examples import ConcatStore
    from jetflow.drafters.training.features import FeatureStore

    folders = [Path(c) for c in corpus_dirs]
    if features_dir and len(folders) > 1:
        raise ConfigError("features names the cache of one corpus; with several corpora leave it unset")
    corpora = [Corpus(f) for f in folders]
    for corpus in corpora:
        if purpose == "train" and corpus.manifest.get("source") in BENCHMARK_NAMES:
            raise ConfigError(
                f"corpus {corpus.path} answers the benchmark set {corpus.manifest['source']!r}: "
                "it is for evaluation (eval_corpus), never for training"
            )
    stores = []
    for corpus in corpora:
        remaining = None if limit is None else limit - sum(len(store) for store in stores)
        if remaining is not None and remaining < 1:
            break
        stores.append(FeatureStore(corpus, layers, Path(features_dir) if features_dir else None, remaining))
    for store in stores:
        made_by = (store.manifest.get("target") or {}).get("fingerprint")
        if made_by is not None and made_by != target.fingerprint():
            raise DataError(
                f"corpus {store.corpus.path} was regenerated by another target than {target.name!r}"
            )
    return stores[0] if len(stores) == 1 else ConcatStore(stores)
