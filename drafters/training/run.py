"""Training as a library call: ``train(config) -> TrainResult``, everything ``jetflow train`` does.

It loads the target, makes the drafter's head (fresh, its recipe fitted to the target; the
trainer resumes or warm-starts it as the config says), opens the corpora's feature caches (or,
``online``, lets the target compute their states as they are read), joins the data-parallel group
``torchrun`` describes (if any), trains, ships the final head and summarises the held-out
curve beside it. Under ``torchrun`` every process calls it; only the first evaluates and writes.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from jetflow.core.errors import ConfigError
from jetflow.core.precision import resolve_dtype
from jetflow.core.registry import default_registry
from jetflow.core.target import Target
from jetflow.drafters.blocks import FrozenTargetParts
from jetflow.drafters.checkpoint import CheckpointInfo, target_record
from jetflow.drafters.learned import LearnedDrafter
from jetflow.drafters.training.config import TrainConfig
from jetflow.drafters.training.curve import CURVE_PLOT, convergence, plot_curve, read_curve
from jetflow.drafters.training.distributed import DataParallel
from jetflow.drafters.training.head_options import fitted_head_options
from jetflow.drafters.training.result import TrainResult
from jetflow.drafters.training.stores import open_store, resolve_corpora
from jetflow.drafters.training.trainer import Trainer

log = logging.getLogger(__name__)


def learned_drafter(name: str) -> type[LearnedDrafter]:
    """The drafter plugin called ``name``, which must have a trainable head."""
    drafter_cls = default_registry().get("drafter", name)
    if not issubclass(drafter_cls, LearnedDrafter):
        raise ConfigError(f"drafter {name!r} has no trainable head")
    return drafter_cls


def shipped_recipe(drafter: str) -> Path:
    """The training recipe the drafter ships beside its module."""
    path = learned_drafter(drafter).default_train_config()
    if not path.is_file():
        raise ConfigError(f"drafter {drafter!r} ships no train config: pass --config FILE")
    return path


def train(config: TrainConfig, *, resume: bool = False, progress: bool = True) -> TrainResult:
    """Train the head of ``config.drafter`` as ``config`` says; its final head lands in ``config.out``.

    ``resume``: continue from the last checkpoint in ``config.out`` where there is one.
    The result of the main process carries the held-out curve's convergence (and
    ``learning_curve.png`` is written beside the log); other processes' results do not.
    """
    drafter_cls = learned_drafter(config.drafter)
    target = Target.load(config.target, dtype=resolve_dtype(config.target_dtype))
    head = drafter_cls.new_head(target, fitted_head_options(config.head, target))
    layers = tuple(head.config.feature_layers)
    corpora, eval_corpus = resolve_corpora(config)
    config = config.model_copy(update={"corpus": corpora, "eval_corpus": eval_corpus})  # the data it saw
    online = config.online  # the target computes the states as they are read: no feature cache
    store = open_store(corpora, config.features, layers, target, limit=config.max_sequences, online=online)
    eval_store = None
    if eval_corpus:
        eval_store = open_store([eval_corpus], None, layers, target, purpose="eval", online=online)
    info = CheckpointInfo(
        drafter=config.drafter,
        architecture=head.config.model_dump(mode="json"),
        target=target_record(target, layers),
    )
    parallel = DataParallel.from_env(target.device)  # under torchrun: one process of several
    try:
        shared = FrozenTargetParts.from_target(target)
        trainer = Trainer(
            config, head, shared, store, info, progress=progress, parallel=parallel, eval_store=eval_store
        )
        result = trainer.fit(resume=resume, target=target)
    finally:
        parallel.close()
    if not parallel.is_main:
        return replace(result, main_process=False)
    points = read_curve(trainer.out)
    settled = convergence(points)
    plot_curve(points, trainer.out / CURVE_PLOT, settled)
    log.info("converged at step %d of %d", settled.step, settled.final_step)
    return replace(result, convergence=settled)
