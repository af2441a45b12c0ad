"""Helpers for head tests: target-regenerated sequences of a tiny target, small heads, checkpoints."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch
from jetflow.core.registry import default_registry
from jetflow.core.target import Target
from jetflow.drafters.block_head import BlockHead, BlockHeadConfig
from jetflow.drafters.blocks import FrozenTargetParts
from jetflow.drafters.checkpoint import CheckpointInfo, save_checkpoint, target_record
from jetflow.drafters.jetflow import plugin
from jetflow.drafters.training import TrainConfig
from jetflow.drafters.training.examples import InMemoryStore, capture_sequences
from jetflow.drafters.training.trainer import Trainer

LAYERS = (1, 2, 3)


@cache
def regenerated_store(
    target: Target, n: int = 48, new_tokens: int = 40, layers: tuple[int, ...] = LAYERS, seed: int = 0
) -> InMemoryStore:
    """Random prompts answered greedily by ``target`` (one batched ``generate``), with its features.

    Cached per target and arguments: several test modules share one miniature corpus.

    All prompts have 8 tokens so no padding is needed; the declared prompt length varies
    (3 to 10) so anchors start at different places.
    """
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, target.vocab_size, (n, 8), generator=generator)
    with torch.inference_mode():
        out = target.model.generate(prompts, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    prompt_lengths = torch.randint(3, 11, (n,), generator=generator).tolist()
    return capture_sequences(target.model, list(out), prompt_lengths, layers, {"source": "tiny-greedy"})


def tiny_head(target: Target, seed: int = 0, **overrides) -> BlockHead:
    torch.manual_seed(seed)
    options = {"feature_layers": LAYERS, "num_layers": 1, "block_size": 6} | overrides
    return BlockHead(BlockHeadConfig.for_target(target, **options))


def head_info(target: Target, head: BlockHead, drafter: str = "jetflow") -> CheckpointInfo:
    return CheckpointInfo(
        drafter=drafter,
        architecture=head.config.model_dump(mode="json"),
        target=target_record(target, head.config.feature_layers),
    )


def save_head(folder: Path, target: Target, head: BlockHead, drafter: str = "jetflow", **kwargs) -> Path:
    return save_checkpoint(folder, head, head_info(target, head, drafter), **kwargs)


def quick_config(**overrides) -> TrainConfig:
    """A few dozen steps of the shared trainer, sized for tests."""
    fields = {
        "steps": 40,
        "batch_sequences": 4,
        "anchors_per_sequence": 16,
        "holdout_sequences": 8,
        "eval_every": 1000,
        "checkpoint_every": 1000,
        "log_every": 5,
        "optim": {"lr": 3e-3, "warmup_steps": 5},
    }
    return TrainConfig.model_validate(fields | overrides)


def quick_trainer(
    target: Target,
    out: Path,
    head: BlockHead | None = None,
    drafter: str = "jetflow",
    eval_store: InMemoryStore | None = None,
    **overrides,
) -> Trainer:
    head = head or tiny_head(target)
    store = regenerated_store(target)
    return Trainer(
        quick_config(**overrides),
        head,
        FrozenTargetParts.from_target(target),
        store,
        head_info(target, head, drafter),
        out=out,
        progress=False,
        eval_store=eval_store,
    )


@contextmanager
def jetflow_registered() -> Iterator[None]:
    """The jetflow plugin in the process registry (until pyproject registers its entry point)."""
    registry = default_registry()
    if "jetflow" in registry.names("drafter"):
        yield
        return
    registry.register(plugin)
    try:
        yield
    finally:
        registry.unregister(plugin)
