"""The batch's nodes split best-first across rows against an equal split, at the same total.

One process, one thread, the same prompts (first turns), each batch size's runs alternating
``ar``, equal, best-first over ``--rounds`` rounds; prints one JSON line per batch size:
    .venv/bin/python experiments/batched/split.py --dataset mtbench --limit 16 --budget 2
``--max-row-shares 2,3`` runs one best-first arm per cap on a row's share
(:data:`jetflow.core.allocation.MAX_ROW_SHARE`; without it, the default cap).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from jetflow.core import allocation
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.precision import resolve_dtype
from jetflow.core.target import Target
from jetflow.data.prompt_sets import load_dataset_samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="mtbench")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--budget", type=int, default=2)
    parser.add_argument("--batch-sizes", default="4,8")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-row-shares", default=str(allocation.MAX_ROW_SHARE))
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = Target.load("default", resolve_dtype("auto"))
    prompts = [sample.messages() for sample in load_dataset_samples(args.dataset, args.limit)]
    common = {"max_new_tokens": args.max_new_tokens, "compile": False}

    def config(drafter: str, tree: dict) -> GenerateConfig:
        return build_config(GenerateConfig, {**common, "drafter": drafter, "tree": tree})

    engines = {"ar": Engine(config("none", {}), target)}
    engines["equal"] = Engine(config("jetflow", {"budget": args.budget, "split": "equal"}), target)
    default_cap, caps = allocation.MAX_ROW_SHARE, {}
    for cap in map(int, args.max_row_shares.split(",")):
        name = "best-first" if cap == default_cap else f"best-first-x{cap}"
        engines[name] = Engine(config("jetflow", {"budget": args.budget, "split": "best-first"}), target)
        caps[name] = cap
    for engine in engines.values():  # warm-up, untimed
        engine.generate_batch(prompts[:2], max_new_tokens=4, batch_size=2)
    for rows in map(int, args.batch_sizes.split(",")):
        seconds = dict.fromkeys(engines, 0.0)
        tokens = dict.fromkeys(engines, 0)
        steps = dict.fromkeys(engines, 0)
        answers: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                allocation.MAX_ROW_SHARE = caps.get(name, default_cap)
                started = time.perf_counter()
                results = engine.generate_batch(prompts, batch_size=rows)
                seconds[name] += time.perf_counter() - started
                tokens[name] += sum(result.new_tokens for result in results)
                steps[name] += sum(len(result.steps) for result in results)
                answers[name] = [result.token_ids for result in results]
        speed = {name: tokens[name] / seconds[name] for name in engines}
        print(
            json.dumps(
                {
                    "dataset": args.dataset,
                    "batch_size": rows,
                    "budget_per_row": args.budget,
                    "tokens_per_s": {name: round(value, 2) for name, value in speed.items()},
                    "speedup_over_ar": {name: round(value / speed["ar"], 3) for name, value in speed.items()},
                    "tau": {name: round(tokens[name] / steps[name], 3) for name in engines},
                    "identical_to_ar": {
                        name: sum(a == b for a, b in zip(answers[name], answers["ar"], strict=True))
                        for name in engines
                    },
                    "prompts": len(prompts),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
