"""Tau of a greedy chain of B drafted tokens, for trained heads, on the held-out corpus's cached features.

tau(B) = 1 + the mean over anchors of how many of the chain's first B tokens the target accepts
(the bonus token counts as one): the training evaluation's chain acceptance, capped at the budget.
Every head reads the same sequences and anchors (the trainer's evaluation seed), so heads trained
online and offline compare on one yardstick. Usage, from the repository root:

    .venv/bin/python experiments/online-training/chain_tau.py runs/online/final runs/offline/final
"""

from __future__ import annotations

import argparse
import json

import torch
from jetflow.core.target import Target
from jetflow.drafters.blocks import FrozenTargetParts
from jetflow.drafters.checkpoint import read_checkpoint
from jetflow.drafters.training.batches import anchored_batch
from jetflow.drafters.training.config import TrainConfig
from jetflow.drafters.training.evaluation import EVAL_SEED, accepted_lengths
from jetflow.drafters.training.objective import Objective
from jetflow.drafters.training.run import learned_drafter
from jetflow.drafters.training.stores import open_store


@torch.no_grad()
def chain_tau(checkpoint: str, budgets: list[int], sequences: int) -> dict[str, float]:
    """``{"tau@B": ...}`` of the head at ``checkpoint`` on the first ``sequences`` held-out sequences."""
    info, _ = read_checkpoint(checkpoint)
    recipe = TrainConfig.model_validate(info.recipe)
    drafter = learned_drafter(recipe.drafter)
    target = Target.load(recipe.target, dtype=torch.float32)
    head, _ = drafter.load_head(checkpoint, target)
    head = head.float().eval()
    shared = FrozenTargetParts.from_target(target)
    objective = Objective.build(shared, head.draft_tokens, recipe.loss, recipe.loss_chunk_rows)
    layers = tuple(head.config.feature_layers)
    store = open_store([recipe.eval_corpus], None, layers, target, purpose="eval")
    generator = torch.Generator().manual_seed(EVAL_SEED)
    runs = []
    for start in range(0, sequences, recipe.batch_sequences):
        ids = list(range(start, min(start + recipe.batch_sequences, sequences)))
        batch = anchored_batch(store, ids, recipe.anchors_per_sequence, generator, torch.device("cpu"))
        preds = head.training_predictions(batch, shared)
        runs.append(accepted_lengths(preds, objective.top1_hits(batch, preds).cpu(), head.max_depth))
    accepted = torch.cat(runs).float()
    return {f"tau@{b}": round(1 + float(accepted.clamp(max=b).mean()), 3) for b in budgets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--budgets", default="4,7")
    parser.add_argument("--sequences", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    budgets = [int(b) for b in args.budgets.split(",")]
    for checkpoint in args.checkpoints:
        print(json.dumps({"checkpoint": checkpoint, **chain_tau(checkpoint, budgets, args.sequences)}))


if __name__ == "__main__":
    main()
