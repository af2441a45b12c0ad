"""How much of a batched drafting step a compiled head would save: the eager head against the same
head whose tensor work (the fusion of new context entries, the block forward, the LM head over the
draft vocabulary) runs through ``torch.compile``, one process, the same prompts, fixed budgets.

An experiment, not a product path: it swaps the head's methods on the instance for compiled
ones, so everything around them (padding, tree building, allocation) is what the engine runs.
The first generation of each method is an untimed warm-up that also pays the compiles.
    .venv/bin/python experiments/batched/head_compile.py --batch-sizes 4,16 --budgets 2,1 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch
from jetflow.core.engine import Engine
from jetflow.core.precision import resolve_dtype
from jetflow.core.target import Target
from jetflow.data.prompt_sets import load_dataset_samples
from jetflow.drafters.jetflow.plugin import JetFlowDrafter
from steps import config, step_report


def compile_head(drafter: JetFlowDrafter) -> None:
    """Route the head's tensor programs through ``torch.compile`` (dynamic shapes: rows, context
    length and new entries vary from step to step)."""
    head = drafter.head
    head.block_hidden = torch.compile(head.block_hidden, dynamic=True)
    head.context_entries = torch.compile(head.context_entries, dynamic=True)
    drafter.logprobs_of = torch.compile(drafter.logprobs_of, dynamic=True)


def timed(engine: Engine, prompts: list, rows: int) -> tuple[str, list[list[int]]]:
    """The run's report line (:func:`steps.step_report`) and every prompt's tokens."""
    engine.generate_batch(prompts[: rows * 2], max_new_tokens=16, batch_size=rows)  # warm-up, untimed
    started = time.perf_counter()
    results = engine.generate_batch(prompts, batch_size=rows)
    wall = time.perf_counter() - started
    return step_report(results, wall), [result.token_ids for result in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--limit", type=int, default=32)
    parser.add_argument("--batch-sizes", default="4,16")
    parser.add_argument("--budgets", default="2,1")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = Target.load("default", resolve_dtype("auto"))
    prompts = [sample.messages() for sample in load_dataset_samples(args.dataset, args.limit)]
    for rows in map(int, args.batch_sizes.split(",")):
        for budget in map(int, args.budgets.split(",")):
            eager = Engine(config(str(budget), args.max_new_tokens), target)
            compiled = Engine(config(str(budget), args.max_new_tokens), target)
            assert isinstance(compiled.drafter, JetFlowDrafter)
            compile_head(compiled.drafter)
            for name, engine in (("eager", eager), ("compiled", compiled), ("eager", eager)):
                line, outputs = timed(engine, prompts, rows)
                if name == "eager":
                    reference = outputs
                same = sum(a == b for a, b in zip(outputs, reference, strict=True))
                verdict = f"{same}/{len(outputs)} outputs as eager's"
                print(f"rows {rows:3d} budget {budget} {name:>8}: {line}, {verdict}", flush=True)


if __name__ == "__main__":
    main()
