"""Batched `ar` with the verify attending over a strided view of the slab (before) or over the
whole fitted slab (after), in one process, alternating, the same prompts.

The "before" arm restores the old ragged write for the run: keys and values returned as the
view ``[:, :, :longest]`` of a slab that doubles when outrun. Prints one line per run:
    .venv/bin/python experiments/batched/slab_attention.py --batch-sizes 4,16,32
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
        .venv/bin/python experiments/batched/slab_attention.py --batch-sizes 16 --limit 16 --dtype float32
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from jetflow.attention.ragged_attention import LAYOUT_KEYWORD, RaggedRows
from jetflow.core.config import GenerateConfig
from jetflow.core.engine import Engine
from jetflow.core.kv_cache import SlabLayer
from jetflow.core.precision import resolve_dtype
from jetflow.core.target import Target
from jetflow.data.prompt_sets import load_dataset_samples


@contextmanager
def strided_view() -> Iterator[None]:
    """The ragged write as it was: a view of the filled part, the slab doubling when outrun."""
    update, fit, layout_of = SlabLayer.update, SlabLayer.fit, vars(RaggedRows)["of"]

    def view_update(self: SlabLayer, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
        layout = kwargs.get("kwargs", {}).get(LAYOUT_KEYWORD)
        if layout is None:
            return update(self, keys, values, *args, **kwargs)
        self.last_layout = layout
        self.key_slab[layout.token_rows, :, layout.token_positions] = keys[0].transpose(0, 1)
        self.value_slab[layout.token_rows, :, layout.token_positions] = values[0].transpose(0, 1)
        self.set_lengths((layout.starts + layout.counts).tolist())
        return self.keys, self.values

    SlabLayer.update, SlabLayer.fit = view_update, SlabLayer.reserve  # type: ignore[method-assign]
    RaggedRows.of = classmethod(
        lambda cls, starts, counts, device, width=0: layout_of.__func__(cls, starts, counts, device)
    )  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        SlabLayer.update, SlabLayer.fit, RaggedRows.of = update, fit, layout_of  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--limit", type=int, default=32)
    parser.add_argument("--batch-sizes", default="4,16,32")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = Target.load("default", resolve_dtype(args.dtype))
    texts = [sample.turns[0] for sample in load_dataset_samples(args.dataset, args.limit)]
    for rows in map(int, args.batch_sizes.split(",")):
        config = GenerateConfig(drafter="none", max_new_tokens=args.max_new_tokens, batch_size=rows)
        engine = Engine(config.model_copy(update={"dtype": args.dtype}), target=target)
        engine.generate_batch(texts[:rows], max_new_tokens=4)  # warm-up
        reference = None
        for round_ in range(args.rounds):
            for before in (True, False) if round_ % 2 == 0 else (False, True):
                with strided_view() if before else nullcontext():
                    start = time.perf_counter()
                    results = engine.generate_batch(texts)
                    wall = time.perf_counter() - start
                tokens = [result.token_ids for result in results]
                reference = reference or tokens
                new = sum(result.new_tokens for result in results)
                prefill = sum(result.prefill_s for result in results)
                differing = sum(a != b for a, b in zip(reference, tokens, strict=True))
                arm = "before" if before else "after"
                print(
                    f"rows {rows:2d} {arm:6s} tokens/s {new / wall:6.1f} decode tokens/s "
                    f"{new / (wall - prefill):6.1f} wall {wall:5.1f} s prefill {prefill:4.1f} s "
                    f"rows differing from the first run {differing}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
