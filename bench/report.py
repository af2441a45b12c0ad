"""Write a comparison's outputs: ``results.json``, ``report.md`` (tables a person reads), plots.

The report is rendered from the results alone, so it can be regenerated from a saved
``results.json`` (:func:`render_markdown`) without rerunning anything.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jetflow.bench.plots import batch_label, is_batched, write_plots
from jetflow.bench.results import BenchResults

log = logging.getLogger(__name__)

RESULTS_JSON = "results.json"
REPORT_MD = "report.md"


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def budget_label(run: dict[str, Any]) -> str:
    """The budget; an adaptive run's most used one with each budget's share of its steps."""
    if run["budget"] is None:
        return "-"
    histogram = run.get("budget_histogram") or {}
    if len(histogram) <= 1:
        return str(run["budget"])
    steps = sum(histogram.values())
    shares = ", ".join(f"{budget}: {count / steps:.0%}" for budget, count in histogram.items())
    return f"{run['budget']} (adaptive; {shares})"


def _histogram(run: dict[str, Any]) -> str:
    histogram = run.get("accept_histogram")
    if histogram is None:
        return "n/a"
    return " ".join(f"{accepted}:{count}" for accepted, count in histogram.items())


def _lossless(run: dict[str, Any]) -> str:
    if run["lossless"] is None:
        return "sampled"
    if not run["lossless"]:
        return "**NO**"
    ties = run.get("rounding_ties", 0)
    return f"yes ({ties} rounding ties)" if ties else "yes"


def _header(results: BenchResults) -> list[str]:
    machine, settings = results.machine, results.settings
    accelerator = machine.get("accelerator") or f"{machine.get('torch_threads')} CPU threads"
    lines = [
        "# jetflow benchmark",
        "",
        f"* target: `{results.target}`, dtype `{settings.get('resolved_dtype')}` "
        f"(asked: `{settings.get('dtype')}`)",
        f"* machine: {machine.get('cpu')}, {accelerator}, native bf16: {machine.get('native_bf16')}, "
        f"CPU kernels {machine.get('cpu_kernels', 'not recorded')}; "
        f"torch {machine.get('torch')}, transformers {machine.get('transformers')}",
        f"* data: {data_line(results)}; max_new_tokens {settings.get('max_new_tokens')} per turn",
        f"* drafters {', '.join(settings.get('drafters', []))} at budgets "
        f"{', '.join(str(b) for b in settings.get('budgets', []))}; "
        "speedup = tokens/s over `ar` (the same engine loop without a drafter) on the same prompts, "
        + (
            "at the same batch size"
            if is_batched(results.runs)
            else "prefill included; decode speedup leaves every prefill out (speculation cannot shorten it)"
        ),
    ]
    commands = settings.get("commands") or [settings.get("command")]
    for command in filter(None, commands):
        lines.append(f"* command: `{command}`")
    failures = results.failures()
    temperature = settings.get("temperature", 0.0)
    if temperature:
        lines += [
            "",
            f"Sampling at temperature {temperature} (every method, `sampling` verifier, seed "
            f"{settings.get('seed')}): outputs are samples, not compared token by token; the "
            "verifier's exactness is proven statistically by the test suite's chi-square tests.",
        ]
    elif failures:
        lines += ["", f"**Lossless check FAILED: {len(failures)} real divergence(s).**"]
    else:
        ties = sum(run.get("rounding_ties", 0) for run in results.runs)
        note = f" ({ties} rounding ties, see below)" if ties else ""
        against = "its reference's (`ar`; `vllm` for vLLM's methods)" if _has_vllm(results.runs) else "`ar`'s"
        lines += ["", f"Lossless check passed: every method's greedy output equals {against}{note}."]
    return lines


def data_line(results: BenchResults) -> str:
    """The data sets the rows measure, and those a run loaded but has not measured yet (a
    resumable comparison saved part-way), so a reader never takes a planned set for a measured one."""
    measured = {run["dataset"] for run in results.runs}
    samples = results.settings.get("n_samples", {})
    line = ", ".join(f"{name} ({count} samples)" for name, count in samples.items() if name in measured)
    pending = [name for name in samples if name not in measured]
    return line + (f"; not yet measured: {', '.join(pending)}" if pending else "")


def _summary(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Best speedup over budgets, one row per method, one column per data set."""
    datasets = list(dict.fromkeys(run["dataset"] for run in runs))
    rows = []
    for method in dict.fromkeys(run["method"] for run in runs):
        cells: list[object] = [f"`{method}`"]
        for dataset in datasets:
            candidates = [r for r in runs if r["method"] == method and r["dataset"] == dataset]
            if not candidates:
                cells.append("-")
                continue
            best = max(candidates, key=lambda r: r["speedup_vs_ar"])
            at = "" if best["budget"] is None else f" (B={best['budget']}, tau {best['tau']:.2f})"
            cells.append(f"{best['speedup_vs_ar']:.2f}x{at}")
        rows.append(cells)
    return ["## Best speedup per method", "", *_table(["method", *datasets], rows)]


def _dataset_tables(runs: Sequence[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    header = [
        "method", "budget", "tau", "tokens/s", "speedup", "decode speedup", "prefill share", "draft share",
        "verify share", "lossless",
    ]  # fmt: skip
    for dataset in dict.fromkeys(run["dataset"] for run in runs):
        rows = [r for r in runs if r["dataset"] == dataset]
        first = rows[0]
        lines += [
            "",
            f"## {dataset}: {first['n_prompts']} prompts, {first['n_turns']} turns, "
            f"{first['new_tokens']} tokens by ar",
            "",
        ]
        lines += _table(
            header,
            [
                [
                    f"`{r['method']}`",
                    budget_label(r),
                    f"{r['tau']:.2f}",
                    f"{r['tokens_per_s']:.1f}",
                    f"{r['speedup_vs_ar']:.2f}x",
                    _optional(r.get("decode_speedup_vs_ar"), "{:.2f}x"),
                    _optional(r.get("prefill_share"), "{:.1%}"),
                    f"{r['draft_share']:.1%}",
                    f"{r['verify_share']:.1%}",
                    _lossless(r),
                ]
                for r in rows
            ],
        )
    return lines


def _optional(value: float | None, form: str) -> str:
    """A figure some methods do not measure (older results, or a prefill they do not time): ``-``."""
    return "-" if value is None else form.format(value)


def _acceptance(runs: Sequence[dict[str, Any]]) -> list[str]:
    rows = [
        [f"`{r['method']}`", budget_label(r), r["dataset"], _histogram(r)]
        for r in runs
        if r["method"] != "ar" and r.get("accept_histogram") != {"0": r["steps"]}
    ]
    if not rows:
        return []
    return [
        "",
        "## Acceptance lengths",
        "",
        "Steps per number of accepted drafted tokens (`accepted:steps`); each step also emits the "
        "target's own next token.",
        "",
        *_table(["method", "budget", "dataset", "histogram"], rows),
    ]


def _divergences(runs: Sequence[dict[str, Any]]) -> list[str]:
    rows = [
        [
            f"`{r['method']}`",
            budget_label(r),
            r["dataset"],
            *_divergence_cells(d),
        ]
        for r in runs
        for d in r.get("divergences", [])
    ]
    if not rows:
        return []
    header = ["method", "budget", "dataset", "sample", "turn", "token", "ar", "method's", "logit gap", "kind"]
    return [
        "",
        "## Divergences from ar",
        "",
        "First differing token per prompt turn. `logit gap`: top logit minus the lower of the two "
        "tokens' logits in a teacher-forced forward of ar's tokens; `tie` means both are within the "
        "tolerance of the top (rounding), `bug` is a real divergence.",
        "",
        *_table(header, rows),
    ]


def _has_vllm(runs: Sequence[dict[str, Any]]) -> bool:
    return any(run.get("reference", "ar") != "ar" for run in runs)


def _engines(results: BenchResults) -> list[str]:
    """vLLM's methods beside jetflow's, each over its own engine's plain decoding (absolute tokens/s too)."""
    runs = results.runs
    if not _has_vllm(runs):
        return []
    rows = [
        [
            f"`{r['method']}`",
            r["dataset"],
            "vLLM" if r.get("reference", "ar") != "ar" else "jetflow",
            f"{r['tokens_per_s']:.1f}",
            f"{r['tau']:.2f}",
            f"{r.get('speedup_vs_reference', r['speedup_vs_ar']):.2f}x over `{r.get('reference', 'ar')}`",
            f"{r['speedup_vs_ar']:.2f}x",
        ]
        for r in sorted(runs, key=lambda r: (r["dataset"], r.get("reference", "ar") != "ar"))
    ]
    header = ["method", "dataset", "engine", "tokens/s", "tau", "speedup over its engine's plain", "over ar"]
    lines = [
        "",
        "## vLLM beside jetflow",
        "",
        "Each engine against its own plain greedy decoding on the same prompts, in the same process "
        "order: jetflow's methods over `ar`, vLLM's over `vllm` (whose `lossless` means: equal to "
        "`vllm`'s output). vLLM's tau and acceptance come from its own spec-decode counters (it "
        "reports no draft/verify split: those shares read 0); `vllm-<drafter>` serves the head "
        "exported by `jetflow export`.",
        "",
        *_table(header, rows),
    ]
    left_out = results.settings.get("left_out") or {}
    if left_out:
        lines += ["", "Not served by vLLM (their heads do not export faithfully):", ""]
        lines += [f"* `{name}`: {reason}" for name, reason in left_out.items()]
    return lines


def _batch_note(results: BenchResults) -> list[str]:
    sizes = ", ".join(str(size) for size in sorted(results.settings.get("batch_sizes") or []))
    lines = [
        "",
        f"Batch axis (batch sizes {sizes}): each method decodes all of a data set's prompts, that "
        "many at a time (continuous batching; `hf-generate`: left-padded batches of `transformers."
        "generate`, each ending with its last row), in one call per user turn. tokens/s is every "
        "row's tokens over the calls' wall time; speedup is over batched `ar` at the same batch size "
        "(and over batched `hf-generate`); tau is per sequence (tokens per forward it took part in); "
        "latency is a sequence's time from its admission to its last token; the batch budget is the "
        "nodes drafted across all rows per forward. Each row is checked against batched `ar` at the "
        "same size and against `ar` at batch size 1.",
    ]
    left_out = results.settings.get("left_out") or {}
    lines += [
        line for name, reason in left_out.items() for line in ("", f"Not batched: `{name}` ({reason}).")
    ]
    return lines


def _batch_summary(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Speedup over ar at each batch size: one row per data set x method, one column per size."""
    sizes = sorted({run["batch_size"] for run in runs})
    rows = []
    for dataset in dict.fromkeys(run["dataset"] for run in runs):
        in_set = [run for run in runs if run["dataset"] == dataset and run["method"] != "ar"]
        for label in dict.fromkeys(batch_label(run) for run in in_set):
            at = {run["batch_size"]: run for run in in_set if batch_label(run) == label}
            cells = [f"{at[size]['speedup_vs_ar']:.2f}x" if size in at else "-" for size in sizes]
            rows.append([dataset, f"`{label}`", *cells])
    if not rows:
        return []
    header = ["dataset", "method", *(f"batch {size}" for size in sizes)]
    return ["## Speedup over ar by batch size", "", *_table(header, rows)]


def _batch_tables(runs: Sequence[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    header = [
        "batch", "method", "budget", "tau", "tokens/s", "speedup", "vs hf-generate", "mean rows",
        "mean latency (s)", "batch budget / forward", "lossless",
    ]  # fmt: skip
    for dataset in dict.fromkeys(run["dataset"] for run in runs):
        rows = sorted((r for r in runs if r["dataset"] == dataset), key=lambda r: r["batch_size"])
        first = rows[0]
        lines += [
            "",
            f"## {dataset}: {first['n_prompts']} prompts, {first['n_turns']} turns, "
            f"{first['new_tokens']} tokens by ar",
            "",
        ]
        lines += _table(
            header,
            [
                [
                    r["batch_size"],
                    f"`{r['method']}`",
                    "-" if r["budget"] is None else r["budget"],
                    f"{r['tau']:.2f}",
                    f"{r['tokens_per_s']:.1f}",
                    f"{r['speedup_vs_ar']:.2f}x",
                    _optional(r.get("speedup_vs_hf_generate"), "{:.2f}x"),
                    f"{r['mean_rows']:.1f}",
                    f"{r['mean_latency_s']:.2f}",
                    _optional(r.get("mean_batch_budget"), "{:.1f}"),
                    _lossless(r),
                ]
                for r in rows
            ],
        )
    return lines


def _batch_divergences(runs: Sequence[dict[str, Any]]) -> list[str]:
    rows = [
        [
            r["batch_size"],
            f"`{r['method']}`",
            r["dataset"],
            d.get("against", "ar"),
            *_divergence_cells(d),
        ]
        for r in runs
        for d in r.get("divergences", [])
    ]
    if not rows:
        return []
    header = ["batch", "method", "dataset", "against", "sample", "turn", "token", "ar", "method's"]
    return [
        "",
        "## Divergences from ar",
        "",
        "First differing token per sequence, against batched `ar` at the same batch size and against "
        "`ar` at batch size 1. `logit gap`: top logit minus the lower of the two tokens' logits in a "
        "teacher-forced forward of ar's tokens; `tie` means both are within the tolerance of the top "
        "(rounding: batching changes the target's matrix shapes as trees do), `bug` is a real divergence.",
        "",
        *_table([*header, "logit gap", "kind"], rows),
    ]


def _divergence_cells(divergence: dict[str, Any]) -> list[object]:
    """Where a divergence is and what it is: the cells every divergence table ends with."""
    gap = divergence["logit_gap"]
    return [
        divergence["sample_id"],
        divergence["turn"],
        divergence["position"],
        divergence["expected"],
        divergence["got"],
        "-" if gap is None else f"{gap:.4f}",
        divergence["kind"],
    ]


def render_markdown(results: BenchResults, plots: Sequence[Path] = ()) -> str:
    lines = _header(results)
    if is_batched(results.runs):
        lines += _batch_note(results)
        lines += ["", *_batch_summary(results.runs), *_batch_tables(results.runs)]
        lines += _batch_divergences(results.runs)
    elif results.runs:
        lines += ["", *_summary(results.runs), *_engines(results), *_dataset_tables(results.runs)]
        lines += _acceptance(results.runs) + _divergences(results.runs)
    if plots:
        lines += ["", "## Plots", ""] + [f"![{path.stem}]({path.name})" for path in plots]
    return "\n".join(lines) + "\n"


def write_outputs(results: BenchResults, folder: str | Path) -> list[Path]:
    """``results.json`` first (so nothing is lost if plotting fails), then plots and report."""
    folder = Path(folder)
    written = [results.write_json(folder / RESULTS_JSON)]
    plots = write_plots(results.runs, folder)
    report = folder / REPORT_MD
    report.write_text(render_markdown(results, plots))
    written += [report, *plots]
    log.info("wrote %s", ", ".join(str(path) for path in written))
    return written
