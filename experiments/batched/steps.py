"""Where a batched step's time goes: drafting and verifying ms per step, tau and nodes per forward,
for `ar` and fixed budgets, one process, one thread (``--threads``), the same prompts (first turns).

Each method is ``ar`` or ``BUDGET[:SPLIT]`` (split ``best-first``, the default, or ``equal``);
``--extra-depth`` sets how far below its share's deepest tree a row drafted past its share may
reach (:data:`jetflow.core.allocation.EXTRA_DEPTH`; a large value drafts every row at its cap):
    .venv/bin/python experiments/batched/steps.py --batch-sizes 4,16 --methods ar,2,2:equal,1
    .venv/bin/python experiments/batched/steps.py --batch-sizes 4,16 --methods 2,1 --extra-depth 99
"""

from __future__ import annotations

import argparse
import time

import torch
from jetflow.core import allocation
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.precision import resolve_dtype
from jetflow.core.result import GenerationResult
from jetflow.core.target import Target
from jetflow.data.prompt_sets import load_dataset_samples


def config(method: str, max_new_tokens: int) -> GenerateConfig:
    common = {"max_new_tokens": max_new_tokens, "compile": False}
    if method == "ar":
        return build_config(GenerateConfig, {**common, "drafter": "none"})
    budget, _, split = method.partition(":")
    tree = {"budget": int(budget), "adapt": False, "split": split or "best-first"}
    return build_config(GenerateConfig, {**common, "tree": tree})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--batch-sizes", default="4,16")
    parser.add_argument("--methods", default="ar,2,2:equal")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--extra-depth", type=int, default=allocation.EXTRA_DEPTH)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    allocation.EXTRA_DEPTH = args.extra_depth
    target = Target.load("default", resolve_dtype("auto"))
    prompts = [sample.messages() for sample in load_dataset_samples(args.dataset, args.limit)]
    for rows in map(int, args.batch_sizes.split(",")):
        for method in args.methods.split(","):
            engine = Engine(config(method, args.max_new_tokens), target)
            engine.generate_batch(prompts[:rows], max_new_tokens=4, batch_size=rows)  # warm-up, untimed
            started = time.perf_counter()
            results = engine.generate_batch(prompts, batch_size=rows)
            wall = time.perf_counter() - started
            print(f"rows {rows:3d} {method:>12}: {step_report(results, wall)}", flush=True)


def step_report(results: list[GenerationResult], wall: float) -> str:
    """A batched run's tokens/s, prefill, steps, ms of drafting and verifying a step, tau and
    drafted nodes a forward."""
    records = [step for result in results for step in result.steps]
    # every row records its step's shared times: weighting each by 1/rows counts each step once
    steps = sum(1 / step.rows for step in records)
    draft = sum(step.draft_s / step.rows for step in records) / steps
    verify = sum(step.verify_s / step.rows for step in records) / steps
    nodes = sum(step.batch_budget / step.rows for step in records) / steps
    tau = sum(step.accepted + 1 for step in records) / len(records)
    generated = sum(result.new_tokens for result in results)
    prefill = sum(result.prefill_s for result in results)
    return (
        f"{generated / wall:6.1f} tokens/s, prefill {prefill:5.1f} s, "
        f"{steps:4.0f} steps, draft {1e3 * draft:5.1f} ms, verify {1e3 * verify:6.1f} ms a step, "
        f"tau {tau:.2f}, {nodes:4.1f} drafted nodes a forward"
    )


if __name__ == "__main__":
    main()
