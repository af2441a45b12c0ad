"""``jetflow generate``: decode one prompt with speculative decoding, optionally beside the baseline."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from jetflow.bench.lossless import DEFAULT_TIE_TOLERANCE, Divergence, LosslessChecker
from jetflow.cli._options import add_compile_flag
from jetflow.core.calibration import ensure_calibration
from jetflow.core.config import NO_DRAFTER, GenerateConfig, build_config, load_toml, merge
from jetflow.core.engine import Engine
from jetflow.core.errors import ConfigError
from jetflow.core.precision import resolve_dtype
from jetflow.core.prompt import check_text
from jetflow.core.registry import default_registry
from jetflow.core.result import GenerationResult
from jetflow.core.target import Target

#: tokens of the untimed warm-up of each engine before ``--compare`` times them
COMPARE_WARMUP_TOKENS = 8


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate an answer with speculative decoding")
    parser.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    parser.add_argument("--config", help="TOML file with GenerateConfig fields; flags override it")
    parser.add_argument("--target", help="'default', a local folder, a .gguf file or a cached hub id")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--drafter", help=f"drafter plugin name, or '{NO_DRAFTER}' for plain decoding")
    parser.add_argument("--tree-policy", help="tree policy plugin name (default: the drafter's)")
    parser.add_argument(
        "--budget",
        help="drafted tree nodes per step, or 'auto': start from the budget `jetflow calibrate` chose "
        "and re-choose it every step from the acceptance seen (default: auto, the first run on a "
        "machine measuring a short calibration)",
    )
    parser.add_argument(
        "--no-adapt",
        dest="adapt",
        action="store_false",
        default=None,
        help="keep the calibrated budget for the whole run instead of re-choosing it",
    )
    parser.add_argument("--width", type=int, help="children proposed per expanded node")
    parser.add_argument("--max-depth", type=int, help="deepest tree level")
    parser.add_argument("--verifier", help="verifier plugin name")
    parser.add_argument("--temperature", type=float, help="sampling verifier: target temperature (> 0)")
    parser.add_argument("--top-p", type=float, help="sampling verifier: nucleus mass in (0, 1]")
    parser.add_argument("--top-k", type=int, help="sampling verifier: keep the k most likely tokens (0: all)")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--threads", type=int, help="torch CPU threads (calibrations are kept per thread count)"
    )
    add_compile_flag(parser)
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--compare", action="store_true", help="also run the autoregressive baseline")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def config_from_args(args: argparse.Namespace) -> GenerateConfig:
    """The TOML file (if any) with every given flag laid over it."""
    base = load_toml(args.config) if args.config else {}
    tree = {
        key: value
        for key, value in {
            "policy": args.tree_policy,
            "budget": args.budget,
            "width": args.width,
            "max_depth": args.max_depth,
            "adapt": args.adapt,
        }.items()
        if value is not None
    }
    flags: dict[str, Any] = {
        "target": args.target,
        "dtype": args.dtype,
        "drafter": args.drafter,
        "verifier": args.verifier,
        "max_new_tokens": args.max_new_tokens,
        "stop": tuple(args.stop) if args.stop else None,
        "seed": args.seed,
        "chat_template": False if args.raw else None,
        "compile": args.compile,
    }
    overrides = {key: value for key, value in flags.items() if value is not None}
    sampling = {
        key: value
        for key, value in {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}.items()
        if value is not None
    }
    if sampling:
        default = GenerateConfig.model_fields["verifier"].default
        verifier = overrides.get("verifier", base.get("verifier", default))
        accepted = default_registry().get("verifier", verifier).Params.model_fields
        if unknown := [f"--{key.replace('_', '-')}" for key in sampling if key not in accepted]:
            raise ConfigError(
                f"{', '.join(unknown)}: not a parameter of the {verifier!r} verifier (try sampling)"
            )
        overrides["verifier_params"] = sampling
    if tree:
        overrides["tree"] = tree
    return build_config(GenerateConfig, merge(base, overrides))


def run(args: argparse.Namespace) -> int:
    if not args.prompt.strip():
        raise ConfigError("the prompt is empty")
    check_text(args.prompt, "--prompt")  # argv bytes that are not UTF-8 arrive as lone surrogates
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    config = config_from_args(args)
    target = Target.load(config.target, resolve_dtype(config.dtype))
    ensure_calibration(config, target, announce=lambda line: print(line, file=sys.stderr))
    engine = Engine(config, target)
    plain = Engine(config.model_copy(update={"drafter": NO_DRAFTER}), target) if args.compare else None
    if plain is not None:  # untimed warm-ups: neither timed run pays the process's first-call costs
        engine.generate(args.prompt, max_new_tokens=COMPARE_WARMUP_TOKENS)
        plain.generate(args.prompt, max_new_tokens=COMPARE_WARMUP_TOKENS)
    result = engine.generate(args.prompt)
    baseline = plain.generate(args.prompt) if plain is not None else None
    if args.json:
        payload: dict[str, Any] = _as_json(result)
        if baseline is not None:
            payload["baseline"] = _as_json(baseline)
            payload["identical_to_baseline"] = baseline.token_ids == result.token_ids
            divergence = _divergence(target, baseline, result)
            payload["divergence"] = None if divergence is None else divergence.as_dict()
        print(json.dumps(payload))
        return 0
    print(result.text)
    print()
    _print_stats(_describe(engine, result), result)
    if baseline is not None:
        _print_stats("ar", baseline)
        speedup = baseline.wall_s / result.wall_s if result.wall_s else float("nan")
        print(f"output {_agreement(_divergence(target, baseline, result))}; speedup {speedup:.2f}x")
    return 0


def _divergence(target: Target, baseline: GenerationResult, result: GenerationResult) -> Divergence | None:
    """Where ``result`` leaves the plain run's tokens, classified as the bench does."""
    checker = LosslessChecker(target, DEFAULT_TIE_TOLERANCE)
    return checker.check("prompt", 0, result.prompt_ids, baseline.token_ids, result.token_ids)


def _agreement(divergence: Divergence | None) -> str:
    if divergence is None:
        return "identical to the baseline"
    where = f"token {divergence.position}"
    if divergence.kind == "tie":
        return (
            f"equal to the baseline up to {where}, where the two differ at a rounding tie of this "
            f"dtype's kernels (logit gap {divergence.logit_gap:.3f}): lossless"
        )
    gap = "" if divergence.logit_gap is None else f", logit gap {divergence.logit_gap:.3f}"
    return f"DIFFERENT from the baseline at {where}{gap}: a bug, please report it"


def _describe(engine: Engine, result: GenerationResult) -> str:
    """``drafter:policy B=<budget> (<where the budget came from>)``, or ``ar``.

    An adaptive budget shows the steps run at each budget: ``B=2 (adaptive: 0x12 2x40)``.
    """
    if result.budget is None:
        return engine.method
    if engine.adaptive is not None:
        steps = " ".join(f"{budget}x{count}" for budget, count in result.budget_histogram().items())
        return f"{engine.method} B={result.budget} ({engine.budget_source}: {steps})"
    note = "no drafting" if result.budget == 0 else ""
    source = ", ".join(part for part in (engine.budget_source, note) if part)
    return f"{engine.method} B={result.budget} ({source})"


def _as_json(result: GenerationResult) -> dict[str, Any]:
    return {"text": result.text, "token_ids": result.token_ids, "stats": result.stats()}


def _print_stats(method: str, result: GenerationResult) -> None:
    stats = result.stats()
    print(
        f"[{method}] {stats['new_tokens']} tokens in {stats['steps']} steps, tau {stats['tau']:.2f}, "
        f"{stats['tokens_per_s']:.1f} tokens/s, draft {stats['draft_s']:.2f}s, "
        f"verify {stats['verify_s']:.2f}s, wall {stats['wall_s']:.2f}s"
    )
