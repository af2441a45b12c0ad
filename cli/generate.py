"""``jetflow generate``: decode one prompt with speculative decoding, optionally beside the baseline,
or a file of prompts in batches (``--prompts-file``: one JSON line out per prompt, in input order).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jetflow.bench.lossless import DEFAULT_TIE_TOLERANCE, Divergence, LosslessChecker
from jetflow.cli._options import add_compile_flag, writable_folder
from jetflow.core.atomic import atomic_path
from jetflow.core.calibration import ensure_calibration
from jetflow.core.config import NO_DRAFTER, GenerateConfig, build_config, load_toml, merge
from jetflow.core.engine import Engine
from jetflow.core.errors import ConfigError, DataError
from jetflow.core.precision import resolve_dtype
from jetflow.core.prompt import Prompt, check_messages, check_text
from jetflow.core.registry import default_registry
from jetflow.core.result import GenerationResult
from jetflow.core.target import Target

#: tokens of the untimed warm-up of each engine before ``--compare`` times them
COMPARE_WARMUP_TOKENS = 8
#: endings of a ``--prompts-file`` read as JSON lines whatever its first line holds
JSON_LINES_SUFFIXES = (".jsonl", ".json-lines")
#: the keys of a JSON-lines object that may hold its prompt (exactly one of them does)
PROMPT_KEYS = ("prompt", "messages", "token_ids")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate an answer with speculative decoding")
    parser.add_argument("--prompt", help="the user message (or raw text with --raw)")
    parser.add_argument(
        "--prompts-file",
        metavar="FILE",
        help="decode every prompt of FILE, --batch-size at a time, and print one JSON object per "
        "prompt in input order: JSON lines (each a string, or an object with 'prompt', 'messages' "
        "or 'token_ids' and an optional 'id' copied to the output) when FILE ends in .jsonl or its "
        "first line is such JSON, else plain text with one prompt per line (blank lines skipped)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        help="with --prompts-file: sequences decoded at once (continuous batching; default: the "
        "config's batch_size, 8)",
    )
    parser.add_argument(
        "--out",
        metavar="FILE",
        help="with --prompts-file: write the JSON lines to FILE (replaced whole) instead of stdout",
    )
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
        "batch_size": args.batch_size,
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
    _check_prompt_flags(args)
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    # the file and the output are checked before any model loads: a typo costs one line, not a load
    prompts = read_prompts_file(args.prompts_file) if args.prompts_file is not None else None
    out = _output_file(args.out) if args.out is not None else None
    config = config_from_args(args)
    target = Target.load(config.target, resolve_dtype(config.dtype))
    ensure_calibration(config, target, announce=lambda line: print(line, file=sys.stderr))
    engine = Engine.from_cache(config, target)
    if prompts is not None:
        return _run_batch(engine, prompts, out)
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


def _check_prompt_flags(args: argparse.Namespace) -> None:
    """One of ``--prompt`` and ``--prompts-file``, and only the flags that go with the one given."""
    if args.prompt is not None and args.prompts_file is not None:
        raise ConfigError("give --prompt or --prompts-file, not both")
    if args.prompt is None and args.prompts_file is None:
        raise ConfigError("give --prompt TEXT or --prompts-file FILE")
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.prompts_file is not None:
        if args.compare:
            raise ConfigError("--compare takes a single --prompt, not --prompts-file")
        return
    if args.out is not None:
        raise ConfigError("--out goes with --prompts-file (with --prompt, redirect --json instead)")
    if not args.prompt.strip():
        raise ConfigError("the prompt is empty")
    check_text(args.prompt, "--prompt")  # argv bytes that are not UTF-8 arrive as lone surrogates


@dataclass(frozen=True)
class FilePrompt:
    """One prompt of a ``--prompts-file``: where it was read and what its output line carries over."""

    prompt: Prompt
    #: ``<file> line <n>`` (1-based, blank lines counted), for messages
    where: str
    #: fields copied to its output object: ``{"id": ...}`` where the line gave one, else nothing
    fields: dict[str, Any] = field(default_factory=dict)


def read_prompts_file(path: str) -> list[FilePrompt]:
    """The prompts of ``path``, in file order; any problem is a one-line :class:`DataError`.

    JSON lines where the file ends in ``.jsonl``/``.json-lines`` or its first non-blank line is a
    JSON string or object: each line a string (a text prompt) or an object with exactly one of
    ``prompt`` (text), ``messages`` (chat messages) or ``token_ids``, and optionally ``id``.
    Otherwise plain text, one prompt a line. Blank lines are skipped in both.
    """
    file = Path(path).expanduser()
    if not file.exists():
        raise DataError(f"--prompts-file {path}: no such file")
    if file.is_dir():
        raise DataError(f"--prompts-file {path}: a folder, not a file")
    try:
        text = file.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise DataError(f"--prompts-file {path}: not UTF-8 text (byte {error.start})") from None
    except OSError as error:
        raise DataError(f"--prompts-file {path}: cannot read it ({error.strerror})") from None
    # split on newlines only: str.splitlines would also break inside a prompt at U+2028 and kin
    lines = [(number, line.rstrip("\r")) for number, line in enumerate(text.split("\n"), start=1)]
    lines = [(number, line) for number, line in lines if line.strip()]
    if not lines:
        raise DataError(f"--prompts-file {path}: no prompts in it (the file is empty or blank)")
    if _is_json_lines(file, lines[0][1]):
        return [_json_line(line, f"{path} line {number}") for number, line in lines]
    return [FilePrompt(line, f"{path} line {number}") for number, line in lines]


def _is_json_lines(file: Path, first: str) -> bool:
    """Whether a prompts file is JSON lines: by its ending, else by its first non-blank line."""
    if file.name.lower().endswith(JSON_LINES_SUFFIXES):
        return True
    try:
        value = json.loads(first)
    except ValueError:
        return False
    return isinstance(value, str | dict)  # a bare number or word-like JSON (`42`, `true`) is text


def _json_line(line: str, where: str) -> FilePrompt:
    """One JSON line of a prompts file as a checked prompt (its token ids are range-checked later,
    against the target's vocabulary)."""
    try:
        value = json.loads(line)
    except ValueError as error:
        raise DataError(f"{where}: not valid JSON ({error})") from None
    if isinstance(value, str):
        return FilePrompt(_text(value, where), where)
    if not isinstance(value, dict):
        raise DataError(f"{where}: expected a JSON string or object, got {_json_kind(value)}")
    keys = [key for key in PROMPT_KEYS if key in value]
    if not keys:
        raise DataError(f"{where}: the object has none of 'prompt', 'messages' or 'token_ids'")
    if len(keys) > 1:
        raise DataError(f"{where}: the object has {' and '.join(map(repr, keys))}; give one of them")
    key, item = keys[0], value[keys[0]]
    fields = {"id": value["id"]} if "id" in value else {}
    if key == "prompt":
        return FilePrompt(_text(item, where, "'prompt'"), where, fields)
    if key == "messages":
        if not isinstance(item, list) or not item:
            raise DataError(f"{where}: 'messages' must be a non-empty list of chat messages")
        try:
            return FilePrompt(check_messages(item), where, fields)
        except (ConfigError, TypeError) as error:
            raise DataError(f"{where}: {error}") from None
    if not isinstance(item, list) or not item:
        raise DataError(f"{where}: 'token_ids' must be a non-empty list of integers")
    for position, token in enumerate(item):
        if isinstance(token, bool) or not isinstance(token, int):
            raise DataError(
                f"{where}: 'token_ids' position {position} holds {json.dumps(token)}, not an integer"
            )
    return FilePrompt(item, where, fields)


def _text(value: object, where: str, what: str = "the prompt") -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {what} must be a string, got {_json_kind(value)}")
    if not value.strip():
        raise DataError(f"{where}: {what} is empty")
    return value


def _json_kind(value: object) -> str:
    """The JSON name of a decoded value's type, for messages."""
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}
    return "null" if value is None else kinds.get(type(value), "an object")


def _output_file(out: str) -> Path:
    """``--out`` as a file path whose folder exists (created if missing) and takes files."""
    path = Path(out).expanduser()
    if path.is_dir():
        raise ConfigError(f"--out {out}: a folder is in the way")
    writable_folder(path.parent, "--out")
    return path


def _run_batch(engine: Engine, prompts: list[FilePrompt], out: Path | None) -> int:
    """Decode every prompt in batches; one JSON line per prompt on stdout (or in ``out``), a
    summary on stderr."""
    ids: list[Prompt] = []
    for item in prompts:  # encoded once here, so a bad prompt is named by its line
        try:
            ids.append(engine.prompt_ids(item.prompt))
        except ConfigError as error:
            raise DataError(f"{item.where}: {error}") from None
    start = time.perf_counter()
    results = engine.generate_batch(ids)
    wall_s = time.perf_counter() - start
    lines = [
        json.dumps({**item.fields, "index": index, **_as_json(result)})
        for index, (item, result) in enumerate(zip(prompts, results, strict=True))
    ]
    if out is None:
        print("\n".join(lines))
    else:
        with atomic_path(out) as staging:
            staging.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    new_tokens = sum(result.new_tokens for result in results)
    speed = new_tokens / wall_s if wall_s else 0.0
    where = f"; written to {out}" if out is not None else ""
    rows = min(engine.config.batch_size, len(prompts))
    print(
        f"[{engine.method} batch of {rows}] {len(prompts)} prompts, {new_tokens} new tokens, "
        f"wall {wall_s:.2f}s, {speed:.1f} tokens/s{where}",
        file=sys.stderr,
    )
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
    return {
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "stats": result.stats(),
    }


def _print_stats(method: str, result: GenerationResult) -> None:
    stats = result.stats()
    print(
        f"[{method}] {stats['new_tokens']} tokens in {stats['steps']} steps, tau {stats['tau']:.2f}, "
        f"{stats['tokens_per_s']:.1f} tokens/s, draft {stats['draft_s']:.2f}s, "
        f"verify {stats['verify_s']:.2f}s, wall {stats['wall_s']:.2f}s"
    )
