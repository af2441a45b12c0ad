"""GPU benchmark: the tree kernel against SDPA with the dense mask, as a verify forward runs them.

For each head layout, prefix length and tree size it times one layer's attention both ways
through transformers' attention-function contract (``sdpa_attention_forward`` with the dense
additive mask, exactly what the SDPA path hands every layer, against
:func:`~jetflow.attention.verify_attention.tree_attention_forward` with the compact tree mask),
checks that the two agree, optionally sweeps the kernel's tiling, and times building each
mask once per verify (the old host-built dense mask plus its copy, the device-built dense mask,
the device-built tree mask). Writes ``results.json`` and ``report.md`` into ``--out``::

    python -m jetflow.attention.bench --out results/tree-attention

Needs a CUDA device; it refuses to run without one (the CPU has no compiled Triton).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from itertools import product
from pathlib import Path

import torch
from jetflow.attention.tree_mask import dense_visibility, tree_mask
from jetflow.attention.verify_attention import tree_attention_forward, verify_mask
from jetflow.core.tree import DraftTree
from torch import Tensor, nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

DEFAULT_PREFIXES = (512, 1024, 2048, 4096, 8192)
DEFAULT_NODES = (16, 32, 64, 128, 256)
#: query heads x key/value heads x head dim: an 8B-class layout (d 128) and a small one (d 64)
DEFAULT_SHAPES = ("32x8x128", "16x4x64")
#: the kernel's tilings a sweep tries: (block_n, num_warps, num_stages); 128 keys per block
#: spill registers on sm_90 at every tile size, so they are not tried
SWEEP = tuple(product((16, 32, 64), (4, 8), (2, 3)))
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass
class Row:
    """One cell of the table: times in milliseconds (medians)."""

    shape: str
    dtype: str
    prefix: int
    nodes: int
    sdpa_ms: float
    tree_ms: float
    speedup: float
    best_tiling: str
    best_ms: float
    max_abs_diff: float
    agrees: bool
    mask_host_dense_ms: float
    mask_device_dense_ms: float
    mask_device_tree_ms: float


class _Layer(nn.Module):
    """What the attention functions read from the calling attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def random_tree(nodes: int, generator: torch.Generator) -> DraftTree:
    parents = torch.cat(
        [torch.tensor([-1]), (torch.rand(nodes - 1, generator=generator) * torch.arange(1, nodes)).long()]
    )
    return DraftTree(tokens=torch.zeros(nodes, dtype=torch.long), parents=parents, scores=torch.zeros(nodes))


def _bench(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _host_ms(fn, reps: int = 30) -> float:
    """Median wall time of ``fn`` with the device synchronised: host work and copies included."""
    times = []
    for _ in range(reps + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[3:])


def _host_dense_mask(ancestor: Tensor, prefix: int, dtype: torch.dtype, device) -> Tensor:
    """The dense mask as the target built it before this kernel: on the host, then copied."""
    visible = dense_visibility(ancestor, prefix)
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def measure(
    shape: str,
    dtype: torch.dtype,
    prefix: int,
    nodes: int,
    sweep: bool,
    device: torch.device | None = None,
    time_device=_bench,
    time_host=_host_ms,
    seed: int = 0,
) -> Row:
    """Time and check one cell (``device`` and the timers are for the tests, which run one
    cell in Triton's interpreter on the CPU)."""
    from jetflow.attention import tree_attention as kernel  # imports triton

    heads, kv_heads, head_dim = map(int, shape.split("x"))
    device = device or torch.device("cuda")
    generator = torch.Generator().manual_seed(seed)
    ancestor = random_tree(nodes, generator).ancestor_mask
    length = prefix + nodes

    def draw(*size: int) -> Tensor:
        return torch.randn(*size, generator=generator).to(device, dtype)

    query = draw(1, nodes, heads, head_dim).transpose(1, 2)  # as the attention module hands it over
    key, value = draw(1, kv_heads, length, head_dim), draw(1, kv_heads, length, head_dim)
    layer = _Layer(heads // kv_heads)
    scale = head_dim**-0.5
    dense = verify_mask(ancestor, prefix, "sdpa", dtype, device)
    compact = verify_mask(ancestor, prefix, "triton-tree", dtype, device)

    def sdpa() -> Tensor:
        return sdpa_attention_forward(layer, query, key, value, dense, scaling=scale)[0]

    def tree() -> Tensor:
        return tree_attention_forward(layer, query, key, value, compact, scaling=scale)[0]

    expected, got = sdpa().float(), tree().float()
    diff = float((expected - got).abs().max())
    sdpa_ms, tree_ms = time_device(sdpa), time_device(tree)
    best_tiling, best_ms = "default", tree_ms
    if sweep:
        for block_n, warps, stages in SWEEP:
            ms = time_device(
                lambda b=block_n, w=warps, s=stages: kernel.tree_attention(
                    query, key, value, compact, scale=scale, block_n=b, num_warps=w, num_stages=s
                )
            )
            if ms < best_ms:
                best_tiling, best_ms = f"n{block_n}/w{warps}/s{stages}", ms
    return Row(
        shape=shape,
        dtype=str(dtype).removeprefix("torch."),
        prefix=prefix,
        nodes=nodes,
        sdpa_ms=round(sdpa_ms, 4),
        tree_ms=round(tree_ms, 4),
        speedup=round(sdpa_ms / tree_ms, 3),
        best_tiling=best_tiling,
        best_ms=round(best_ms, 4),
        max_abs_diff=diff,
        agrees=diff <= TOLERANCE[dtype],
        mask_host_dense_ms=round(time_host(lambda: _host_dense_mask(ancestor, prefix, dtype, device)), 4),
        mask_device_dense_ms=round(
            time_host(lambda: verify_mask(ancestor, prefix, "sdpa", dtype, device)), 4
        ),
        mask_device_tree_ms=round(time_host(lambda: tree_mask(ancestor.to(device), prefix)), 4),
    )


def environment() -> dict[str, str]:
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
    }


def report(rows: list[Row], env: dict[str, str]) -> str:
    """The markdown table: one row per cell."""
    lines = [
        "# Tree attention vs SDPA with the dense mask (one layer's attention, one verify)",
        "",
        ", ".join(f"{k} {v}" for k, v in env.items()),
        "",
        "Times are medians in ms (`triton.testing.do_bench`; mask builds by wall clock with the device "
        "synchronised). speedup = sdpa / tree at the default tiling; best = the fastest tiling of the "
        "sweep (block_n/num_warps/num_stages). Masks are built once per verify forward, attention runs "
        "once per layer.",
        "",
        "| heads x kv x dim | dtype | prefix | nodes | sdpa | tree | speedup | best tiling | best | "
        "max abs diff | agrees | dense mask (host+copy) | dense mask (device) | tree mask (device) |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.shape} | {r.dtype} | {r.prefix} | {r.nodes} | {r.sdpa_ms:.4f} | {r.tree_ms:.4f} | "
            f"{r.speedup:.2f} | {r.best_tiling} | {r.best_ms:.4f} | {r.max_abs_diff:.2e} | "
            f"{'yes' if r.agrees else '**no**'} | {r.mask_host_dense_ms:.4f} | "
            f"{r.mask_device_dense_ms:.4f} | {r.mask_device_tree_ms:.4f} |"
        )
    return "\n".join(lines) + "\n"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jetflow.attention.bench",
        description="Time the Triton tree attention against SDPA with the dense mask on a CUDA GPU; "
        "write results.json and report.md.",
    )
    parser.add_argument("--out", type=Path, default=Path("results/tree-attention"))
    parser.add_argument("--prefixes", type=_ints, default=DEFAULT_PREFIXES, help="comma-separated")
    parser.add_argument("--nodes", type=_ints, default=DEFAULT_NODES, help="comma-separated tree sizes")
    parser.add_argument(
        "--shapes", default=",".join(DEFAULT_SHAPES), help="comma-separated HEADSxKV_HEADSxHEAD_DIM"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--no-sweep", action="store_true", help="time the default tiling only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the tree-attention benchmark needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    rows = []
    for shape in args.shapes.split(","):
        for prefix, nodes in product(args.prefixes, args.nodes):
            row = measure(shape, dtype, prefix, nodes, sweep=not args.no_sweep)
            print(
                f"{shape} {args.dtype} prefix {prefix:>5} nodes {nodes:>3}: sdpa {row.sdpa_ms:.4f} ms, "
                f"tree {row.tree_ms:.4f} ms ({row.speedup:.2f}x; best {row.best_ms:.4f} {row.best_tiling}), "
                f"diff {row.max_abs_diff:.1e}",
                flush=True,
            )
            rows.append(row)
    env = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps({"environment": env, "rows": [asdict(row) for row in rows]}, indent=2) + "\n"
    )
    (args.out / "report.md").write_text(report(rows, env))
    print(f"wrote {args.out / 'results.json'} and {args.out / 'report.md'}")
    return 0 if all(row.agrees for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
