"""One trainer for every learned draft head: the fit loop.

A head plugs in through :class:`~jetflow.drafters.training.contracts.TrainableHead`; the rest
is shared and lives beside this loop, one job a module: the draft vocabulary
(:mod:`.vocabulary`), the teacher and losses (:mod:`.objective`), the batches (:mod:`.batches`),
held-out evaluation (:mod:`.evaluation`), resumable checkpoints (:mod:`.checkpoints`), the
optimiser, schedule and mixed precision (:mod:`.optim`) and the log (:mod:`.run_log`). Here: AdamW steps
with gradient clipping, data-parallel over processes, with periodic evaluation, logging and
checkpoints, exact resume or a warm restart from a head's weights and step, and the final head.

Output folder::

    train_log.jsonl                      one record per logged step and per evaluation
    checkpoints/step-0000500/            fp32 weights + config.json + trainer.pt (resume state)
    final/                               the shippable head (``ship_dtype``) + config.json
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from jetflow.core.errors import CheckpointMismatchError, ConfigError
from jetflow.core.precision import resolve_dtype
from jetflow.core.target import Target
from jetflow.drafters.blocks import FrozenTargetParts
from jetflow.drafters.checkpoint import CheckpointInfo, save_checkpoint
from jetflow.drafters.training.batches import StepSequences, anchored_batch, split_ids
from jetflow.drafters.training.checkpoints import ResumeState, RunCheckpoints, load_head
from jetflow.drafters.training.config import TrainConfig
from jetflow.drafters.training.contracts import SequenceStore, TrainableHead, check_store_layers
from jetflow.drafters.training.distributed import DataParallel
from jetflow.drafters.training.evaluation import evaluate
from jetflow.drafters.training.losses import position_losses
from jetflow.drafters.training.objective import LossFn, Objective
from jetflow.drafters.training.optim import adamw, restarted_lr_factor, step_autocast
from jetflow.drafters.training.result import TrainResult
from jetflow.drafters.training.run_log import RunLog
from jetflow.drafters.training.vocabulary import choose_draft_vocab, recorded_vocab
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class Trainer:
    """Trains one head on one sequence store; see the module docstring for the layout."""

    def __init__(
        self,
        config: TrainConfig,
        head: TrainableHead,
        shared: FrozenTargetParts,
        store: SequenceStore,
        info: CheckpointInfo,
        out: str | Path | None = None,
        progress: bool = True,
        loss_fn: LossFn = position_losses,
        parallel: DataParallel | None = None,
        eval_store: SequenceStore | None = None,
    ) -> None:
        """``eval_store``: evaluate on it (else on sequences held out of ``store``)."""
        self.config = config
        self.parallel = parallel or DataParallel()
        if config.batch_sequences < self.parallel.world:
            raise ConfigError(
                f"batch_sequences {config.batch_sequences} is the global batch: it needs at least "
                f"one sequence for each of the {self.parallel.world} processes"
            )
        self.head, self.shared, self.info = head, shared, info
        self.store = store
        self.eval_store = eval_store if eval_store is not None else store
        self.device = shared.lm_head.weight.device
        head.to(self.device)
        self.out = Path(out or config.out)
        self.progress = progress
        self.loss_fn = loss_fn
        check_store_layers(store, tuple(info.target.get("feature_layers", ())))
        separate_eval = self.eval_store if self.eval_store is not store else None
        self.train_ids, self.eval_ids = split_ids(
            store, separate_eval, config.holdout_sequences, config.max_sequences
        )
        self.sequences = StepSequences(self.train_ids, config.batch_sequences, config.seed)
        self.vocab_summary: dict[str, Any] = {}
        if head.draft_tokens is not None:
            vocab_size = int(shared.lm_head.weight.shape[0])
            self.vocab_summary = choose_draft_vocab(head.draft_tokens, store, self.train_ids, vocab_size)
        self.parallel.broadcast_([*head.parameters(), *head.buffers()])
        self.objective = self._objective()
        self.optimizer = adamw(head.parameters(), config.optim)
        self._restart_step = 0  # the step a warm restart began at (0: none); the rate re-warms from it
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        #: compute dtype of the training steps (the autocast dtype; fp32 means no autocast)
        self.compute_dtype = resolve_dtype(config.precision, self.device)
        self.step = 0
        self.checkpoints = RunCheckpoints(self.out, config.keep_checkpoints)
        self.log = RunLog(self.out)
        self._prior_s = 0.0  # training seconds of the runs before this one
        self._started: float | None = None  # when this run's loop began

    def _objective(self) -> Objective:
        """The objective over the head's current draft vocabulary."""
        cfg = self.config
        return Objective.build(
            self.shared, self.head.draft_tokens, cfg.loss, cfg.loss_chunk_rows, self.loss_fn
        )

    def _lr_factor(self, optimizer_step: int) -> float:
        return restarted_lr_factor(optimizer_step, self._restart_step, self.config.optim, self.config.steps)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, Any]:
        """Held-out loss, per-depth top-1 agreement with the target and chain acceptance."""
        cfg = self.config
        return evaluate(
            self.head,
            self.objective,
            self.eval_store,
            self.eval_ids,
            cfg.batch_sequences,
            cfg.anchors_per_sequence,
        )

    # ------------------------------------------------------------------ checkpoints
    def _info(self, **state: Any) -> CheckpointInfo:
        """The checkpoint description: ``info`` plus the recipe, the data summary and progress."""
        data = self.info.data or dict(self.store.manifest)
        data = data | {"train_sequences": len(self.train_ids), "holdout_sequences": len(self.eval_ids)}
        if self.eval_store is not self.store:
            data["eval_corpus"] = self.eval_store.manifest.get("corpus")
        data = data | self.vocab_summary
        recipe = self.config.model_dump(mode="json")
        return replace(self.info, recipe=recipe, data=data, state={"step": self.step, **state})

    def save(self) -> Path:
        """A resumable checkpoint of the current step; old ones beyond ``keep_checkpoints`` go."""
        state = ResumeState(
            step=self.step,
            optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict(),
            train_s=self.train_s,
            restart_step=self._restart_step,
        )
        return self.checkpoints.save(self.head, self._info(), state)

    def resume(self, target: Target | None = None) -> bool:
        """Restore the latest checkpoint under ``out``; false if there is none."""
        folder = self.checkpoints.latest()
        if folder is None:
            return False
        self._load_head(folder, target, "resume")
        saved = ResumeState.read(folder)
        self._restart_step = saved.restart_step
        self.optimizer.load_state_dict(saved.optimizer)
        self.scheduler.load_state_dict(saved.scheduler)
        self.step = saved.step
        self._prior_s = saved.train_s
        log.info("resumed from %s (step %d)", folder, self.step)
        return True

    def warm_start(self, folder: str | Path, target: Target | None = None) -> None:
        """Continue from a head checkpoint's weights and step, with a fresh optimiser.

        This is the restart of a long run whose resumable state (the optimiser moments, a few
        times the head's size) was not kept: the schedule goes on from the head's step, and
        the rate re-warms over ``warmup_steps`` while the moments refill.
        """
        info = self._load_head(Path(folder), target, "warm-start")
        step = info.state.get("step")
        if not isinstance(step, int) or step < 1:
            raise CheckpointMismatchError(f"cannot warm-start from {folder}: it records no training step")
        if step >= self.config.steps:
            raise ConfigError(f"{folder} is at step {step} already: ask for more steps than that")
        self.step = self._restart_step = step
        self._prior_s = float(info.state.get("train_s", 0.0))
        self.vocab_summary = recorded_vocab(info.data)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        log.info("warm-started from %s (step %d)", folder, self.step)

    def _load_head(self, folder: Path, target: Target | None, purpose: str) -> CheckpointInfo:
        info = load_head(self.head, folder, self.info, target, purpose)
        self.objective = self._objective()  # the checkpoint's draft vocabulary
        return info

    # ------------------------------------------------------------------ loop
    @property
    def train_s(self) -> float:
        """Seconds of training so far, summed over every resumed run (evaluations included)."""
        running = time.perf_counter() - self._started if self._started is not None else 0.0
        return self._prior_s + running

    def train_step(self) -> dict[str, float]:
        """One optimiser step on the batch of ``self.step``; returns its statistics.

        Data-parallel, each process back-propagates its predictions' share of the global
        weighted mean and the gradients are summed: the update of one process on it all.
        """
        cfg = self.config
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step)
        ids = self.sequences.ids(self.step)
        batch = anchored_batch(
            self.store, ids, cfg.anchors_per_sequence, generator, self.device, self.parallel
        )
        with step_autocast(self.device, self.compute_dtype):
            preds = self.head.training_predictions(batch, self.shared)
            total, weight = self.objective.loss_terms(batch, preds)
        positions = torch.tensor(float(preds.hidden.shape[0]), device=total.device)
        sums = self.parallel.sum_(torch.stack([total.detach(), weight.detach(), positions]))
        loss = total / sums[1].clamp(min=1e-9)
        self.optimizer.zero_grad(set_to_none=True)
        if loss.requires_grad:  # a process whose sequences supervise nothing adds no gradient
            loss.backward()
        self.parallel.sum_gradients(self.head.parameters())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.head.parameters(), cfg.optim.grad_clip)
        lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return {
            "loss": float(sums[0] / sums[1].clamp(min=1e-9)),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "positions": int(sums[2]),
        }

    def _continue(self, resume: bool, target: Target | None) -> None:
        """Pick up where an earlier run stopped (its checkpoint, else the warm start), or start afresh."""
        continued = resume and self.resume(target)
        if not continued and self.config.warm_start:
            self.warm_start(self.config.warm_start, target)
            continued = True
        if self.parallel.is_main:
            if continued:
                self.log.keep_until(self.step)
            else:
                self.log.clear()

    def fit(self, resume: bool = False, target: Target | None = None) -> TrainResult:
        """Train to ``config.steps``, evaluating, logging and checkpointing on the way.

        Data-parallel, every process trains; only the main one evaluates, logs and writes
        checkpoints (the others return an empty evaluation).
        """
        cfg, main = self.config, self.parallel.is_main
        self.out.mkdir(parents=True, exist_ok=True)
        self._continue(resume, target)
        self.parallel.barrier()  # nobody trains (or logs) before the main process set up the folder
        self.head.train()
        start, positions = time.perf_counter(), 0.0
        self._started = start
        evaluation: dict[str, Any] = {}
        shown = self.progress and main
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step", disable=not shown)
        while self.step < cfg.steps:
            stats = self.train_step()
            positions += stats["positions"]
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.3f}", lr=f"{stats['lr']:.1e}")
            if not main:
                continue
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                self.log.append({"step": self.step, **stats, "elapsed_s": round(self.train_s, 2)})
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                evaluation = self.evaluate()
                self.log.append(
                    {"step": self.step, "eval": True, **evaluation, "elapsed_s": round(self.train_s, 2)}
                )
                log.info("step %d: %s", self.step, evaluation)
            if self.step % cfg.checkpoint_every == 0 and self.step < cfg.steps:
                self.save()
        bar.close()
        wall = time.perf_counter() - start
        final = self.out / "final"
        if main and not evaluation:
            evaluation = self.evaluate()
        train_s = self.train_s  # one reading, so the shipped head and the result agree
        if main:
            info = self._info(**evaluation, wall_s=round(wall, 1), train_s=round(train_s, 1))
            save_checkpoint(final, self.head.state_dict(), info, _DTYPES[cfg.ship_dtype])
            self.save()
        self.parallel.barrier()  # the checkpoints exist once any process returns
        return TrainResult(self.step, wall, train_s, positions / max(wall, 1e-9), final, evaluation)
