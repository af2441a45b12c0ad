"""One trainer for every learned draft head.

A head plugs in through :class:`TrainableHead` (a module with ``config``, ``max_depth`` and
``training_predictions(batch, shared) -> Predictions``) and an optional per-position loss
hook; everything else is shared: random anchors per sequence, the teacher distribution
from the target's frozen LM head over its cached final hidden states (restricted to the
head's draft vocabulary when it has one, chosen here from response-token frequencies,
which cuts the LM-head cost that dominates training on a CPU), forward-KL / SFT /
reverse-KL with per-depth weights, AdamW with warm-up and cosine or WSD decay, gradient
clipping, periodic checkpoints with exact resume (or a warm restart from a head's weights and
step), a held-out split with per-depth top-1 agreement with the target, a progress bar and a
JSON-lines loss log.

Output folder::

    train_log.jsonl                      one record per logged step and per evaluation
    checkpoints/step-0000500/            fp32 weights + config.json + trainer.pt (resume state)
    final/                               the shippable head (``ship_dtype``) + config.json
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, Self

import torch
import torch.nn.functional as F
from jetflow.core.config import build_config, load_layered_toml, merge
from jetflow.core.errors import CheckpointMismatchError, ConfigError
from jetflow.core.precision import resolve_dtype
from jetflow.drafters.blocks import DraftLMHead, FrozenTargetParts
from jetflow.drafters.checkpoint import (
    CheckpointInfo,
    check_target,
    read_checkpoint,
    save_checkpoint,
)
from jetflow.drafters.examples import ExampleBatch, Predictions
from jetflow.drafters.training.distributed import DataParallel
from jetflow.drafters.training.examples import SequenceStore, collate, response_token_counts, sample_anchors
from jetflow.drafters.training.losses import LossConfig, depth_weights, position_losses
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

LossFn = Callable[[LossConfig, Tensor, Tensor | None, Tensor], Tensor]
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OptimConfig(_Frozen):
    """AdamW with linear warm-up, then a decay to ``min_lr_ratio * lr`` by the last step.

    ``cosine`` decays over the whole run. ``wsd`` (warm-up, stable, decay) holds the peak rate
    and decays linearly over the last ``decay_steps`` only: a run can be judged converged at
    the stable rate, and extended with ``--steps`` across sessions, before it anneals.
    """

    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = Field(50, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float = Field(1.0, gt=0)
    schedule: Literal["cosine", "wsd"] = "cosine"
    decay_steps: int = Field(0, ge=0, description="wsd: steps of the final linear decay")

    @model_validator(mode="after")
    def _decay_is_given(self) -> Self:
        if self.schedule == "wsd" and self.decay_steps < 1:
            raise ValueError("the wsd schedule needs decay_steps >= 1")
        return self


class TrainConfig(_Frozen):
    """Everything that decides one training run (``jetflow train --config FILE``)."""

    drafter: str = Field("jetflow", description="drafter plugin whose head is trained")
    target: str = Field("default", description="target spec, as for `jetflow generate`")
    corpus: list[str] | None = Field(
        None,
        description="corpus folder(s), read as one; default: the default target's first and second turns",
    )
    features: str | None = Field(
        None, description="feature cache folder of a single corpus; default: its cache"
    )
    out: str = Field("runs/train", description="output folder: log, checkpoints, final head")
    head: dict[str, Any] = Field(default_factory=dict, description="head hyper-parameters (drafter's own)")
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    steps: int = Field(1000, ge=1)
    batch_sequences: int = Field(4, ge=1, description="sequences per optimiser step")
    anchors_per_sequence: int = Field(64, ge=1, description="random anchors drawn per sequence")
    holdout_sequences: int = Field(
        32, ge=0, description="sequences evaluated on: of eval_corpus, else held out of the training data"
    )
    eval_corpus: str | None = Field(
        None,
        description=(
            "corpus folder evaluated on (never trained on); default: the first corpus's `-heldout` "
            "sibling where it exists, else holdout_sequences drawn from the training data"
        ),
    )
    max_sequences: int | None = Field(
        None, ge=2, description="use only the first N sequences (fixed-data ablations); None: all"
    )
    warm_start: str | None = Field(
        None,
        description=(
            "head checkpoint to continue from when no resumable state is left (a final head or a "
            "checkpoint folder): its weights and step; the optimiser moments start at zero and the "
            "rate re-warms over warmup_steps. A resumable checkpoint in `out` wins over it"
        ),
    )
    eval_every: int = Field(100, ge=1)
    checkpoint_every: int = Field(250, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    log_every: int = Field(10, ge=1)
    loss_chunk_rows: int = Field(1024, ge=1, description="rows per LM-head chunk (bounds memory)")
    seed: int = 0
    ship_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description=(
            "dtype of the head's matrix products in training steps (autocast; the weights, the "
            "optimiser, the teacher and evaluation stay fp32); auto: bf16 where it is native"
        ),
    )

    @field_validator("corpus", mode="before")
    @classmethod
    def _one_corpus_is_a_list(cls, value: Any) -> Any:
        """A recipe may name a single corpus as a string; everything downstream reads a list."""
        return [value] if isinstance(value, str) else value

    @classmethod
    def from_toml(
        cls, path: str | Path, settings: dict[str, Any] | None = None, **overrides: Any
    ) -> TrainConfig:
        """Read a recipe file (on top of its ``base``); ``settings`` (``--set``) and overrides win."""
        data = merge(load_layered_toml(path), settings or {})
        data |= {key: value for key, value in overrides.items() if value is not None}
        return build_config(cls, data)


class TrainableHead(Protocol):
    """What the trainer needs from a head module."""

    config: BaseModel  # hyper-parameters, saved as the checkpoint's architecture
    max_depth: int
    draft_tokens: Tensor | None  # [N] draft-vocabulary ids (the trainer fills them), or None

    def training_predictions(self, batch: ExampleBatch, shared: FrozenTargetParts) -> Predictions: ...


class TrainableDrafter(Protocol):
    """What a drafter plugin class offers the trainer: a fresh head for a target."""

    name: ClassVar[str]

    @classmethod
    def new_head(cls, target: Any, options: dict[str, Any]) -> nn.Module: ...


@dataclass(frozen=True)
class TrainResult:
    """What a finished run reports."""

    steps: int
    wall_s: float  # this run
    train_s: float  # every run that led here (resumes included)
    positions_per_s: float
    final_checkpoint: Path
    evaluation: dict[str, Any]


def lr_factor(step: int, config: OptimConfig, total_steps: int) -> float:
    """Multiplier of the base learning rate at ``step`` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    floor = config.min_lr_ratio
    if config.schedule == "wsd":
        decay_start = max(total_steps - config.decay_steps, config.warmup_steps)
        progress = min(max(step - decay_start, 0) / max(total_steps - decay_start, 1), 1.0)
        return floor + (1 - floor) * (1 - progress)
    progress = min((step - config.warmup_steps) / max(total_steps - config.warmup_steps, 1), 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    """Trains one head on one sequence store; see the module docstring for the layout."""

    def __init__(
        self,
        config: TrainConfig,
        head: nn.Module,
        shared: FrozenTargetParts,
        store: SequenceStore,
        info: CheckpointInfo,
        out: str | Path | None = None,
        progress: bool = True,
        loss_fn: LossFn = position_losses,
        parallel: DataParallel | None = None,
        eval_store: SequenceStore | None = None,
    ) -> None:
        self.config = config
        self.parallel = parallel or DataParallel()
        if config.batch_sequences < self.parallel.world:
            raise ConfigError(
                f"batch_sequences {config.batch_sequences} is the global batch: it needs at least "
                f"one sequence for each of the {self.parallel.world} processes"
            )
        self.head = head
        self.shared = shared
        self.store = store
        #: where evaluation reads: a separate held-out store, or the training store's held-out ids
        self.eval_store = eval_store if eval_store is not None else store
        self.info = info
        head.to(shared.lm_head.weight.device)
        self.out = Path(out or config.out)
        self.progress = progress
        self.loss_fn = loss_fn
        self._check_layers()
        self.train_ids, self.eval_ids = self._split()
        self.vocab_size = int(shared.lm_head.weight.shape[0])
        self.vocab_summary = self._choose_draft_vocab()
        self.parallel.broadcast_(head)
        self.lm = DraftLMHead.build(shared.lm_head, getattr(head, "draft_tokens", None))
        decay = [p for p in head.parameters() if p.ndim >= 2]
        no_decay = [p for p in head.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": config.optim.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=config.optim.lr,
            betas=config.optim.betas,
        )
        #: the step a warm restart began at (0: none); the rate re-warms from it
        self._restart_step = 0
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        device = shared.lm_head.weight.device
        #: compute dtype of the training steps (the autocast dtype; fp32 means no autocast)
        self.compute_dtype = resolve_dtype(config.precision, device)
        self.step = 0
        self._prior_s, self._started = 0.0, None  # see train_s
        self._epoch_order: tuple[int, Tensor] | None = None  # (epoch, permutation of train_ids)

    # ------------------------------------------------------------------ setup
    def _lr_factor(self, optimizer_step: int) -> float:
        """The schedule at the run's step, re-warmed after a warm restart's fresh moments."""
        factor = lr_factor(self._restart_step + optimizer_step, self.config.optim, self.config.steps)
        if self._restart_step and self.config.optim.warmup_steps:
            factor *= min(1.0, (optimizer_step + 1) / self.config.optim.warmup_steps)
        return factor

    def _check_layers(self) -> None:
        layers = tuple(getattr(self.store, "layers", ()) or ())
        wanted = tuple(self.info.target.get("feature_layers", ()))
        if layers and wanted and layers != wanted:
            raise ConfigError(
                f"the feature cache holds layers {list(layers)}, but the head reads {list(wanted)}"
            )

    def _split(self) -> tuple[Tensor, Tensor]:
        """Training ids and evaluation ids, both fixed (independent of the training seed).

        With a separate evaluation store, every training sequence trains and evaluation reads
        its first ``holdout_sequences``: runs on different amounts of data share one yardstick.
        """
        n = min(len(self.store), self.config.max_sequences or len(self.store))
        if n < 1:
            raise ConfigError("the training data holds no sequences")
        if self.eval_store is not self.store:
            return torch.arange(n), torch.arange(min(self.config.holdout_sequences, len(self.eval_store)))
        holdout = min(self.config.holdout_sequences, n // 2)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(1234))
        if n - holdout < 1:
            raise ConfigError(f"the data has {n} sequences: too few to train on")
        return order[holdout:], order[:holdout]

    def _choose_draft_vocab(self) -> dict[str, Any]:
        """Fill the head's draft vocabulary with the most frequent training-response tokens.

        Returns what is recorded in the checkpoint: its size and the share of training
        response tokens it covers (the ceiling of any draft's per-token agreement).
        """
        tokens = getattr(self.head, "draft_tokens", None)
        if tokens is None:
            return {}
        size = int(tokens.shape[0])
        if size >= self.vocab_size:
            raise ConfigError(
                f"draft_vocab_size {size} must be below the target's vocabulary ({self.vocab_size})"
            )
        counts = response_token_counts(self.store, self.train_ids.tolist(), self.vocab_size)
        chosen = torch.sort(counts, descending=True, stable=True).indices[:size]
        with torch.no_grad():
            tokens.copy_(chosen.sort().values)
        coverage = float(counts[chosen].sum() / counts.sum().clamp(min=1))
        log.info("draft vocabulary: %d tokens cover %.2f%% of training responses", size, 100 * coverage)
        return {"draft_vocab_size": size, "draft_vocab_coverage": round(coverage, 5)}

    # ------------------------------------------------------------------ data
    def _sequence_ids(self, step: int) -> list[int]:
        """The sequences of ``step``: consecutive slices of per-epoch permutations (resumable)."""
        n, size = len(self.train_ids), self.config.batch_sequences
        ids = []
        for slot in range(step * size, (step + 1) * size):
            epoch, offset = divmod(slot, n)
            if self._epoch_order is None or self._epoch_order[0] != epoch:
                generator = torch.Generator().manual_seed(self.config.seed * 100_003 + epoch)
                self._epoch_order = (epoch, torch.randperm(n, generator=generator))
            ids.append(int(self.train_ids[self._epoch_order[1][offset]]))
        return ids

    def _batch(
        self,
        ids: list[int],
        generator: torch.Generator,
        shard: bool = False,
        store: SequenceStore | None = None,
    ) -> ExampleBatch:
        """The batch of sequences ``ids`` of ``store`` (default: the training store); with
        ``shard``, only this process's share of them.

        Anchors are drawn for every sequence of ``ids`` in order, so a sequence gets the
        same anchors whichever process trains on it.
        """
        records = [(store or self.store).sequence(i) for i in ids]
        anchors = [
            sample_anchors(
                prompt, tokens.shape[0], features.shape[0], self.config.anchors_per_sequence, generator
            )
            for tokens, prompt, features, _ in records
        ]
        if shard:
            mine = self.parallel.shard(range(len(ids)))
            records, anchors = [records[i] for i in mine], [anchors[i] for i in mine]
        return collate(records, anchors, dtype=torch.float32).to(self.shared.lm_head.weight.device)

    # ------------------------------------------------------------------ loss
    def _teacher_logprobs(
        self, batch: ExampleBatch, preds: Predictions, temperature: float
    ) -> tuple[Tensor, Tensor]:
        """Teacher log-probs over the draft vocabulary, once per distinct position.

        Returns ``([U, N], inverse [M])``; restricted to a draft vocabulary, the softmax is
        the target's distribution renormalised onto it.
        """
        unique, inverse = self._teacher_positions(batch, preds)
        with torch.no_grad(), torch.autocast(batch.final.device.type, enabled=False):
            logits = self.lm.logits(batch.final.flatten(0, 1)[unique].float())
            if temperature != 1.0:
                logits = logits / temperature
            return F.log_softmax(logits, dim=-1), inverse

    @staticmethod
    def _teacher_positions(batch: ExampleBatch, preds: Predictions) -> tuple[Tensor, Tensor]:
        """Distinct flat rows of ``batch.final`` that teach the predictions: ``([U], inverse [M])``."""
        flat = preds.rows * batch.final.shape[1] + preds.positions - 1
        return torch.unique(flat, return_inverse=True)

    def _loss(self, batch: ExampleBatch, preds: Predictions) -> Tensor:
        """Weighted mean loss over predictions, the LM head applied in checkpointed chunks."""
        total, weight = self._loss_terms(batch, preds)
        return total / weight.clamp(min=1e-9)

    def _loss_terms(self, batch: ExampleBatch, preds: Predictions) -> tuple[Tensor, Tensor]:
        """The weighted sum of the predictions' losses and the sum of their weights."""
        cfg = self.config.loss
        labels = self.lm.columns(batch.tokens[preds.rows, preds.positions], self.vocab_size)
        teacher, inverse = (None, None)
        if cfg.needs_teacher:
            teacher, inverse = self._teacher_logprobs(batch, preds, cfg.temperature)
        weights = depth_weights(preds.depths, cfg.depth_decay)
        if cfg.kind == "sft" and cfg.sft_labels == "tokens":
            weights = weights * (labels >= 0)  # a token outside the draft vocabulary teaches nothing
            labels = labels.clamp(min=0)

        def chunk_loss(hidden: Tensor, teacher_rows: Tensor | None, chunk_labels: Tensor) -> Tensor:
            return self.loss_fn(cfg, self.lm.logits(hidden), teacher_rows, chunk_labels)

        rows, total = preds.hidden.shape[0], preds.hidden.new_zeros((), dtype=torch.float32)
        step = self.config.loss_chunk_rows
        for start in range(0, rows, step):
            part = slice(start, start + step)
            teacher_rows = None if teacher is None else teacher[inverse[part]]
            args = (preds.hidden[part], teacher_rows, labels[part])
            losses = checkpoint(chunk_loss, *args, use_reentrant=False) if rows > step else chunk_loss(*args)
            total = total + (losses * weights[part]).sum()
        return total, weights.sum().to(total.dtype)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Held-out loss, per-depth top-1 agreement with the target and chain acceptance.

        ``chain_accept`` is the mean number of leading depths whose top-1 equals the
        target's: the drafted tokens a greedy chain would get accepted per step.
        """
        if len(self.eval_ids) == 0:
            return {}
        self.head.eval()
        depth = self.head.max_depth
        agree = torch.zeros(depth)
        count = torch.zeros(depth)
        loss_sum, accepted, n_anchors = 0.0, 0.0, 0
        generator = torch.Generator().manual_seed(4321)
        size = self.config.batch_sequences
        for start in range(0, len(self.eval_ids), size):
            batch = self._batch(
                [int(i) for i in self.eval_ids[start : start + size]], generator, store=self.eval_store
            )
            preds = self.head.training_predictions(batch, self.shared)
            if preds.hidden.shape[0] == 0:
                continue
            loss_sum += float(self._loss(batch, preds)) * preds.hidden.shape[0]
            hits = self.top1_hits(batch, preds).cpu()
            depths = preds.depths.cpu() - 1
            agree += torch.bincount(depths, weights=hits.float(), minlength=depth)
            count += torch.bincount(depths, minlength=depth).float()
            runs = accepted_lengths(preds, hits, depth)
            accepted += float(runs.sum())
            n_anchors += int(runs.shape[0])
        self.head.train()
        total = float(count.sum())
        return {
            "eval_loss": loss_sum / max(total, 1.0),
            "agreement": [round(float(a / c), 4) if c else None for a, c in zip(agree, count, strict=True)],
            "chain_accept": accepted / max(n_anchors, 1),
        }

    @torch.no_grad()
    def top1_hits(self, batch: ExampleBatch, preds: Predictions) -> Tensor:
        """``[M]`` bool: the head's top-1 draft token equals the target's greedy token."""
        unique, inverse = self._teacher_positions(batch, preds)
        target_top = self.shared.logits(batch.final.flatten(0, 1)[unique]).argmax(-1)  # full vocabulary
        drafted = torch.cat(
            [
                self.lm.token_ids(self.lm.logits(preds.hidden[part]).argmax(-1))
                for part in _chunks(preds.hidden.shape[0], self.config.loss_chunk_rows)
            ]
        )
        return drafted == target_top[inverse]

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_dir(self, step: int) -> Path:
        return self.out / "checkpoints" / f"step-{step:07d}"

    def _info(self, **state: Any) -> CheckpointInfo:
        """The checkpoint description: ``info`` plus the recipe, the data summary and progress."""
        data = self.info.data or dict(getattr(self.store, "manifest", None) or {})
        data = data | {"train_sequences": len(self.train_ids), "holdout_sequences": len(self.eval_ids)}
        if self.eval_store is not self.store:
            data["eval_corpus"] = (getattr(self.eval_store, "manifest", None) or {}).get("corpus")
        data = data | self.vocab_summary
        recipe = self.config.model_dump(mode="json")
        return replace(self.info, recipe=recipe, data=data, state={"step": self.step, **state})

    def save(self) -> Path:
        """A resumable checkpoint of the current step; old ones beyond ``keep_checkpoints`` go."""
        folder = save_checkpoint(self._checkpoint_dir(self.step), self.head, self._info())
        torch.save(
            {
                "step": self.step,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "train_s": self.train_s,
                "restart_step": self._restart_step,
            },
            folder / "trainer.pt",
        )
        for old in self._checkpoints()[: -self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return folder

    def _checkpoints(self) -> list[Path]:
        root = self.out / "checkpoints"
        found = [
            p for p in root.glob("step-*") if (p / "trainer.pt").is_file() and (p / "config.json").is_file()
        ]
        return sorted(found)

    def resume(self, target=None) -> bool:
        """Restore the latest checkpoint under ``out``; false if there is none."""
        found = self._checkpoints()
        if not found:
            return False
        folder = found[-1]
        self._load_head(folder, target, "resume")
        saved = torch.load(folder / "trainer.pt", weights_only=True)
        self._restart_step = int(saved.get("restart_step", 0))
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.step = int(saved["step"])
        self._prior_s = float(saved.get("train_s", 0.0))
        log.info("resumed from %s (step %d)", folder, self.step)
        return True

    def warm_start(self, folder: str | Path, target=None) -> None:
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
        self.vocab_summary = {k: v for k, v in info.data.items() if k.startswith("draft_vocab")}
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        log.info("warm-started from %s (step %d)", folder, self.step)

    def _load_head(self, folder: Path, target, purpose: str) -> CheckpointInfo:
        """Load a checkpoint's weights into the head after checking they fit this run."""
        info, state = read_checkpoint(folder)
        if target is not None:
            check_target(info, target, source=f"checkpoint {folder}", drafter=self.info.drafter)
        if info.architecture != self.info.architecture:
            raise CheckpointMismatchError(
                f"cannot {purpose} from {folder}: it was trained as head {info.architecture}, "
                f"this run asks for {self.info.architecture}"
            )
        self.head.load_state_dict(state)
        self.lm = DraftLMHead.build(self.shared.lm_head, getattr(self.head, "draft_tokens", None))
        return info

    # ------------------------------------------------------------------ log
    def _log(self, record: dict[str, Any]) -> None:
        with open(self.out / "train_log.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def _trim_log(self, step: int) -> None:
        """Drop log records written after ``step`` by the interrupted run."""
        path = self.out / "train_log.jsonl"
        if path.is_file():
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
            path.write_text("".join(line + "\n" for line in kept))

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
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.step)
        batch = self._batch(self._sequence_ids(self.step), generator, shard=True)
        with self._autocast():
            preds = self.head.training_predictions(batch, self.shared)
            total, weight = self._loss_terms(batch, preds)
        positions = torch.tensor(float(preds.hidden.shape[0]), device=total.device)
        sums = self.parallel.sum_(torch.stack([total.detach(), weight.detach(), positions]))
        loss = total / sums[1].clamp(min=1e-9)
        self.optimizer.zero_grad(set_to_none=True)
        if loss.requires_grad:  # a process whose sequences supervise nothing adds no gradient
            loss.backward()
        self.parallel.sum_gradients(self.head.parameters())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.config.optim.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return {
            "loss": float(sums[0] / sums[1].clamp(min=1e-9)),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "positions": int(sums[2]),
        }

    @contextlib.contextmanager
    def _autocast(self) -> Iterator[None]:
        """Mixed precision for a training step: matrix products in ``compute_dtype``.

        Norms then see bf16 inputs with fp32 weights, which torch computes correctly on its
        unfused path and warns about on every call; the warning is silenced here only.
        """
        device = self.shared.lm_head.weight.device
        enabled = self.compute_dtype != torch.float32
        with warnings.catch_warnings(), torch.autocast(device.type, self.compute_dtype, enabled=enabled):
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            yield

    def fit(self, resume: bool = False, target=None) -> TrainResult:
        """Train to ``config.steps``, evaluating, logging and checkpointing on the way.

        Data-parallel, every process trains; only the main one evaluates, logs and writes
        checkpoints (the others return an empty evaluation).
        """
        main = self.parallel.is_main
        self.out.mkdir(parents=True, exist_ok=True)
        continued = resume and self.resume(target)
        if not continued and self.config.warm_start:
            self.warm_start(self.config.warm_start, target)
            continued = True
        if main and continued:
            self._trim_log(self.step)
        elif main and (self.out / "train_log.jsonl").exists():
            (self.out / "train_log.jsonl").unlink()
        self.parallel.barrier()  # nobody trains (or logs) before the main process set up the folder
        cfg = self.config
        self.head.train()
        start, positions = time.perf_counter(), 0
        self._started = start
        evaluation: dict[str, Any] = {}
        bar = tqdm(
            total=cfg.steps,
            initial=self.step,
            desc="train",
            disable=not (self.progress and main),
            unit="step",
        )
        while self.step < cfg.steps:
            stats = self.train_step()
            positions += stats["positions"]
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.3f}", lr=f"{stats['lr']:.1e}")
            if not main:
                continue
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                self._log({"step": self.step, **stats, "elapsed_s": round(self.train_s, 2)})
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                evaluation = self.evaluate()
                self._log(
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
            save_checkpoint(final, self.head, info, _DTYPES[cfg.ship_dtype])
            self.save()
        self.parallel.barrier()  # the checkpoints exist once any process returns
        return TrainResult(self.step, wall, train_s, positions / max(wall, 1e-9), final, evaluation)


def _chunks(rows: int, size: int) -> list[slice]:
    return [slice(start, start + size) for start in range(0, rows, size)]


def accepted_lengths(preds: Predictions, hits: Tensor, max_depth: int) -> Tensor:
    """Per anchor, how many leading depths agree with the target: ``[A]``, ordered by (row, anchor).

    This is exactly what greedy verification of the head's top-1 chain from that root
    accepts: while every earlier depth agreed, the drafted prefix is the true one.
    """
    rows, depths = preds.rows.cpu(), preds.depths.cpu()
    anchors = preds.positions.cpu() - depths
    keys = rows * (int(anchors.max()) + 1) + anchors
    unique, index = torch.unique(keys, return_inverse=True)
    dense = torch.zeros(unique.shape[0], max_depth, dtype=torch.bool)
    dense[index, depths - 1] = hits.cpu()
    return dense.to(torch.long).cumprod(dim=1).sum(dim=1)
