"""``jetflow bench``: every method side by side on real data sets; results.json, report.md, plots.

Names (drafters, policies, data sets) are validated before the target loads, so a typo
costs milliseconds. A real divergence from the baseline's greedy output is a failed run:
the results are still written, then the command says what diverged and exits 1. With
``--batch-sizes`` every method runs at every batch size (:mod:`jetflow.bench.batched`).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jetflow.cli._options import add_compile_flag, writable_folder

if TYPE_CHECKING:
    from jetflow.bench.config import BenchConfig
    from jetflow.bench.results import BenchResults

EXIT_NOT_LOSSLESS = 1
#: under --out: each unfinished data set's journal of finished samples
JOURNAL_DIR = "journal"
#: under --out: the calibrations its ``auto`` runs started from (a resume starts from them again)
CALIBRATION_DIR = "calibration"
#: flags that map one to one onto :class:`~jetflow.bench.config.BenchConfig` fields
_CONFIG_FLAGS = (
    *("drafters", "datasets", "limit", "budgets", "max_new_tokens", "batch_sizes"),
    *("dtype", "target", "threads", "temperature", "seed", "out", "vllm", "compile"),
)


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="compare drafters and baselines on benchmark data sets",
        description="Run ar, hf-generate, hf-prompt-lookup and each drafter at each budget on the "
        "same prompts; write results.json, report.md and plots. With --batch-sizes, every method "
        "decodes the prompts at every batch size (speedup and drafted budget against batch size).",
    )
    parser.add_argument("--config", metavar="TOML", help="a bench config file; flags override it")
    parser.add_argument(
        "--drafters", type=_names, help="comma list of NAME or NAME:POLICY (e.g. ngram:chain)"
    )
    parser.add_argument(
        "--datasets", type=_names, help="comma list: champ, humaneval, mtbench, sharegpt, file:PATH"
    )
    parser.add_argument("--limit", type=int, help="first N samples of each data set (default 20)")
    parser.add_argument("--budgets", type=_names, help="comma list of tree budgets (default 8,16,32)")
    parser.add_argument("--max-new-tokens", type=int, help="per turn (default 128)")
    parser.add_argument(
        "--batch-sizes",
        type=_names,
        metavar="B,B,...",
        help="comma list of batch sizes (e.g. 1,2,4,8,16,32): every method decodes each data set's "
        "prompts that many at a time, its throughput against batched ar at the same size; the report "
        "and plots then show speedup and drafted budget against batch size (default: each prompt alone)",
    )
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--target", help="'default', a local folder, a .gguf file or a cached hub id")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--temperature",
        type=float,
        help="0 (default): greedy, checked against ar; > 0: every method samples at this temperature",
    )
    parser.add_argument("--seed", type=int, help="seed of the sampling runs (default 0)")
    add_compile_flag(parser)
    parser.add_argument("--out", help="output folder (default results/)")
    parser.add_argument(
        "--vllm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run vllm, vllm-ngram and vllm-<drafter> for each drafter whose head exports "
        "(in .venv-vllm: `make vllm`); their speedups are over vllm, jetflow's over ar "
        "(--no-vllm: jetflow's methods only, where the config file asks for vLLM)",
    )
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--resume",
        action="store_true",
        help="keep the data sets already in OUT/results.json (same settings) and the samples journaled "
        "in OUT/journal by a stopped run, and run the rest, its auto runs starting from the calibrations "
        "kept in OUT/calibration; processes given different --datasets can fill one OUT side by side",
    )
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results OUT holds even where they were measured with other settings "
        "(without it, and without --resume, such a run is refused)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that were given, as config keys."""
    return {name: getattr(args, name) for name in _CONFIG_FLAGS if getattr(args, name) is not None}


def command_line(config: BenchConfig, config_file: str | None) -> str:
    """A command that reruns this comparison, recorded in results and report."""
    from jetflow.core.config import load_toml

    words = ["jetflow", "bench"] + (["--config", config_file] if config_file else [])
    words += ["--drafters", ",".join(config.drafters), "--datasets", ",".join(config.datasets)]
    if config.limit is not None:
        words += ["--limit", str(config.limit)]
    words += ["--budgets", ",".join(map(str, config.budgets)), "--max-new-tokens", str(config.max_new_tokens)]
    if config.batch_sizes is not None:
        words += ["--batch-sizes", ",".join(map(str, config.batch_sizes))]
    words += ["--dtype", config.dtype, "--target", config.target, "--out", config.out]
    if config.threads is not None:
        words += ["--threads", str(config.threads)]
    if not config.greedy:
        words += ["--temperature", str(config.temperature), "--seed", str(config.seed)]
    if config.vllm:
        words.append("--vllm")
    elif config_file and load_toml(config_file).get("vllm"):
        words.append("--no-vllm")  # the file turns vLLM on: the rerun must turn it off again
    if config.compile is not None:
        words.append("--compile" if config.compile else "--no-compile")
    return shlex.join(words)


def run(args: argparse.Namespace) -> int:
    from jetflow.bench.config import load_bench_config
    from jetflow.bench.out_lock import hold_out_folder

    config = load_bench_config(args.config, overrides(args))
    out = writable_folder(config.out)  # before the target loads: a bad --out costs one line
    with hold_out_folder(out, shared=args.resume):
        results, paths = _measure(config, out, args)
    for run_row in results.runs:
        budget = "" if run_row["budget"] is None else f" B={run_row['budget']}"
        budget += f" batch {run_row['batch_size']}" if "batch_size" in run_row else ""
        speedup = run_row.get("speedup_vs_reference", run_row["speedup_vs_ar"])
        print(
            f"{run_row['dataset']:<12} {run_row['method'] + budget:<28} tau {run_row['tau']:5.2f}  "
            f"{run_row['tokens_per_s']:7.1f} tok/s  {speedup:5.2f}x vs {run_row.get('reference', 'ar')}"
            f"{'  NOT LOSSLESS' if run_row['lossless'] is False else ''}"
        )
    print("wrote " + ", ".join(str(path) for path in paths))
    if not results.lossless:
        failures = results.failures()
        print(f"jetflow: error: lossless check failed ({len(failures)} real divergences):", file=sys.stderr)
        for line in failures:
            print(f"  {line}", file=sys.stderr)
        return EXIT_NOT_LOSSLESS
    return 0


def _measure(config: BenchConfig, out: Path, args: argparse.Namespace) -> tuple[BenchResults, list[Path]]:
    """Run the comparison into ``out`` (held by this run) and write its outputs.

    Without ``--resume`` or ``--overwrite``, results of other settings already in ``out`` stop
    the run before the target loads.
    """
    from jetflow.bench.report import RESULTS_JSON, write_outputs
    from jetflow.bench.results import BenchResults, merge_saved, refuse_other_results
    from jetflow.bench.runner import run_benchmark

    command = command_line(config, args.config) + (" --resume" if args.resume else "")
    saved = out / RESULTS_JSON
    if not (args.resume or args.overwrite):
        refuse_other_results(saved, config.model_dump(mode="json"))
    previous = BenchResults.read_json(saved) if args.resume and saved.exists() else None

    def save(results: BenchResults) -> BenchResults:
        results.settings["command"] = command
        if args.resume:  # other processes may be filling the same file with other data sets
            return merge_saved(saved, results)
        results.write_json(saved)
        return results

    def save_dataset(results: BenchResults) -> None:
        save(results)

    results = run_benchmark(
        config,
        progress=not args.no_progress,
        previous=previous,
        on_dataset=save_dataset,
        journal_dir=out / JOURNAL_DIR,
        resume=args.resume,
        kept_calibrations=out / CALIBRATION_DIR,
    )
    return results, write_outputs(save(results), config.out)
