"""Measure a SmolLM2-sized block head on this machine: decode-step time and training throughput.

Run: ``.venv/bin/python -m jetflow.drafters.training.head_speed [--layers 1 2] [--steps 6]``.
Prints one JSON line per measurement: a measurement, not a test (no time is asserted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from jetflow.core.contracts import DraftContext
from jetflow.core.target import Target
from jetflow.drafters.blocks import FrozenTargetParts
from jetflow.drafters.checkpoint import CheckpointInfo, save_checkpoint, target_record
from jetflow.drafters.jetflow.plugin import BlockHeadParams, JetFlowDrafter
from jetflow.drafters.training.examples import capture_sequences
from jetflow.drafters.training.trainer import TrainConfig, Trainer


def _info(target: Target, head) -> CheckpointInfo:
    architecture = head.config.model_dump(mode="json")
    return CheckpointInfo("jetflow", architecture, target_record(target, head.config.feature_layers))


def _options(layers: int, vocab: int | None) -> dict:
    return {"num_layers": layers} | ({"draft_vocab_size": vocab} if vocab else {})


def decode_step(
    target: Target, layers: int, vocab: int | None, context: int = 300, repeats: int = 30
) -> dict:
    """Median seconds of ``begin`` (extend by 3 tokens + one block forward + LM head + log-softmax)."""
    head = JetFlowDrafter.new_head(target, _options(layers, vocab))
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(folder, head, _info(target, head))
        drafter = JetFlowDrafter(BlockHeadParams(checkpoint=folder), target)
    k = len(drafter.feature_layers)
    features = torch.randn(context + 3 * (repeats + 5), k, target.hidden_size)
    tokens = torch.randint(0, target.vocab_size, (features.shape[0] + 1,))
    drafter.reset()
    drafter.begin(DraftContext(tokens[: context + 1], features[:context], context))
    times, n = [], context
    for _ in range(repeats + 5):
        start = time.perf_counter()
        drafter.begin(DraftContext(tokens[: n + 4], features[n : n + 3], n + 3))
        times.append(time.perf_counter() - start)
        n += 3
    params = sum(p.numel() for p in drafter.head.parameters())
    return {
        "what": "decode_step",
        "layers": layers,
        "draft_vocab": vocab,
        "threads": torch.get_num_threads(),
        "params": params,
        "median_ms": 1e3 * statistics.median(times[5:]),
    }


def training(
    target: Target,
    layers: int,
    vocab: int | None,
    steps: int,
    anchors: int,
    batch: int = 4,
    length: int = 320,
) -> dict:
    """Positions (supervised anchor-depth pairs) per second of the shared trainer."""
    generator = torch.Generator().manual_seed(0)
    sequences = [
        torch.randint(0, target.vocab_size, (length,), generator=generator) for _ in range(batch * 2)
    ]
    head = JetFlowDrafter.new_head(target, _options(layers, vocab))
    store = capture_sequences(target.model, sequences, [64] * len(sequences), head.config.feature_layers)
    config = TrainConfig(
        steps=steps + 1,
        batch_sequences=batch,
        anchors_per_sequence=anchors,
        holdout_sequences=0,
        log_every=1000,
    )
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            config, head, FrozenTargetParts.from_target(target), store, _info(target, head), out, False
        )
        trainer.train_step()  # warm-up
        start, positions = time.perf_counter(), 0
        for _ in range(steps):
            positions += trainer.train_step()["positions"]
        wall = time.perf_counter() - start
    return {
        "what": "training",
        "layers": layers,
        "draft_vocab": vocab,
        "threads": torch.get_num_threads(),
        "anchors_per_sequence": anchors,
        "batch_sequences": batch,
        "s_per_step": wall / steps,
        "positions_per_s": positions / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--anchors", type=int, nargs="+", default=[32])
    parser.add_argument("--vocab", type=int, nargs="+", default=[0, 8192], help="draft vocabulary; 0: full")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = Target.load("default", torch.float32)
    for vocab in args.vocab:
        for layers in args.layers:
            print(json.dumps(decode_step(target, layers, vocab or None)), flush=True)
    if args.skip_training:
        return
    for vocab in args.vocab:
        for layers in args.layers:
            for anchors in args.anchors:
                print(json.dumps(training(target, layers, vocab or None, args.steps, anchors)), flush=True)


if __name__ == "__main__":
    main()
