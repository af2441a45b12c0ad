"""``jetflow data``: regenerate the training corpus with the target, cache its features, show stats."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from jetflow.core.calibration import ensure_calibration
from jetflow.core.config import NO_DRAFTER, GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.errors import ConfigError
from jetflow.core.precision import resolve_dtype
from jetflow.core.target import Target
from jetflow.data import prompt_sets
from jetflow.drafters.head_sizes import default_feature_layers
from jetflow.drafters.training import second_turns
from jetflow.drafters.training.corpus import Corpus, combined_stats
from jetflow.drafters.training.corpus_folders import (
    corpus_dir_for,
    default_eval_corpus_dir,
    heldout_dir,
    second_turn_dir,
    training_corpus_dirs,
)
from jetflow.drafters.training.features import build_features
from jetflow.drafters.training.regenerate import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_SHARD_SIZE,
    regenerate,
    select_prompts,
)

#: the one benchmark set regeneration answers: into the evaluation corpus ``<name>-heldout``
HELDOUT_SOURCE = "sharegpt-heldout"


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids, got {text!r}") from error


def _part(text: str) -> tuple[int, int]:
    """``K/N``: the K-th of N processes that share one job."""
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise argparse.ArgumentTypeError(f"expected K/N with 1 <= K <= N, got {text!r}")
    return int(k), int(n)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "data", help="regenerate the training corpus, cache target features, stats"
    )
    actions = parser.add_subparsers(dest="data_action", required=True, metavar="ACTION")
    dtypes = ["auto", "float32", "bfloat16", "float16"]

    regen = actions.add_parser(
        "regenerate", help="let the target answer training prompts greedily (resumable)"
    )
    regen.add_argument(
        "--target", default="default", help="'default', a folder, a .gguf file or a cached hub id"
    )
    regen.add_argument(
        "--source",
        default="sharegpt",
        help=f"sharegpt, file:PATH.jsonl of prompts, or {HELDOUT_SOURCE} (evaluation corpus <name>-heldout)",
    )
    regen.add_argument(
        "--n",
        type=int,
        help="conversations in the finished corpus (required for first turns; second turns: at most)",
    )
    regen.add_argument(
        "--turn",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: answer each conversation's follow-up after the first-turn corpus's own answer",
    )
    regen.add_argument(
        "--parent", type=Path, help="--turn 2: the first-turn corpus (default: the target's packaged one)"
    )
    regen.add_argument(
        "--follow",
        action="store_true",
        help="--turn 2: keep answering (full shards) while the first-turn run still grows its corpus",
    )
    regen.add_argument("--max-new-tokens", type=int, default=256)
    regen.add_argument(
        "--max-prompt-tokens",
        type=int,
        help=f"longer prompts are skipped (default {DEFAULT_MAX_PROMPT_TOKENS}; second turns "
        f"{second_turns.DEFAULT_MAX_PROMPT_TOKENS})",
    )
    regen.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    shard_help = "conversations per resumable shard, sorted by length into batches"
    regen.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE, help=shard_help)
    regen.add_argument("--dtype", choices=dtypes, default="auto")
    regen.add_argument("--out", type=Path, help="corpus folder (default: the packaged corpora/<target name>)")
    regen.add_argument(
        "--layers", type=_layer_list, help="feature layers, e.g. 1,8,14,20,27 (default: 5 spread)"
    )
    regen.add_argument("--no-features", action="store_true", help="skip the feature capture")
    regen.add_argument(
        "--drafter",
        help="with --no-features: decode through the batched speculative engine with this drafter "
        f"(e.g. jetflow, ngram; '{NO_DRAFTER}': its plain batched decoding); the same greedy tokens "
        "(default: the plain batched greedy loop, which also captures features)",
    )
    regen.add_argument(
        "--budget",
        help="with --drafter: drafted tree nodes per step, or 'auto' (the calibrated budget; default: "
        "as `jetflow generate`, the calibrated one, measured once on first use)",
    )
    regen.add_argument("--threads", type=int, help="torch CPU threads (1 is fastest on a busy machine)")

    feats = actions.add_parser("features", help="(re)build the feature cache of a corpus by teacher forcing")
    corpus_help = (
        "corpus folder, repeatable (default: the training corpora, first and second turns; "
        "features: and the held-out evaluation corpus)"
    )
    feats.add_argument("--corpus", type=Path, action="append", help=corpus_help)
    feats.add_argument("--target", default="default")
    feats.add_argument("--dtype", choices=dtypes, default="auto")
    feats.add_argument("--layers", type=_layer_list, help="feature layers (default: 5 spread)")
    feats.add_argument("--token-budget", type=int, default=8192, help="padded tokens per forward")
    feats.add_argument("--threads", type=int, help="torch CPU threads")
    feats.add_argument(
        "--max-sequences",
        type=int,
        metavar="N",
        help="only the shards holding each corpus's first N sequences (a run with max_sequences=N)",
    )
    feats.add_argument(
        "--part",
        type=_part,
        default=(1, 1),
        metavar="K/N",
        help="compute every N-th shard, starting at the K-th: N processes (one per core) share the work",
    )

    stats = actions.add_parser("stats", help="summary of a corpus")
    stats.add_argument("--corpus", type=Path, action="append", help=corpus_help)
    stats.add_argument("--json", action="store_true", help="print one JSON object")

    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return {"regenerate": _regenerate, "features": _features, "stats": _stats}[args.data_action](args)


def _load_target(args: argparse.Namespace):
    """The target in the asked dtype, after applying ``--threads`` (OpenMP threads that share
    two cores with other jobs spin on each other's barriers: one thread is often faster)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return Target.load(args.target, dtype=resolve_dtype(args.dtype))


def _regenerate(args: argparse.Namespace) -> int:
    if args.turn == 1 and args.n is None:
        raise ConfigError("--n is required for first turns")
    sizes = (args.n or 1, args.max_new_tokens, args.batch_size, args.shard_size, args.max_prompt_tokens or 1)
    if min(sizes) < 1:
        raise ConfigError(
            "--n, --max-new-tokens, --max-prompt-tokens, --batch-size and --shard-size must be positive"
        )
    heldout = args.source == HELDOUT_SOURCE
    if args.source in prompt_sets.BENCHMARK_NAMES and not (heldout and args.turn == 1):
        raise ConfigError(
            f"--source {args.source!r} is a benchmark set; training data must never contain it "
            f"(first turns of {HELDOUT_SOURCE!r} make the evaluation corpus, which training refuses)"
        )
    config = _engine_config(args)  # checked before any model loads
    if args.turn == 2:
        if config is not None:
            raise ConfigError("--drafter decodes first turns only (second turns use the plain loop)")
        return _regenerate_second_turns(args)
    if heldout:
        samples, source_info = prompt_sets.load_sharegpt_heldout(), {"split": HELDOUT_SOURCE}
    else:
        samples, source_info = _training_samples(args.source)
    target = _load_target(args)
    max_prompt_tokens = args.max_prompt_tokens or DEFAULT_MAX_PROMPT_TOKENS
    selection = select_prompts(
        samples,
        target.encode_prompt,
        args.n,
        max_prompt_tokens=max_prompt_tokens,
        exclude=set() if heldout else prompt_sets.benchmark_prompt_texts(),
    )
    layers = None if args.no_features else (args.layers or default_feature_layers(target.num_layers))
    out = args.out or corpus_dir_for(target.name)
    if heldout and not args.out:
        out = heldout_dir(out)
    engine = None
    if config is not None:
        ensure_calibration(config, target, announce=lambda line: print(line, file=sys.stderr))
        engine = Engine.from_cache(config, target)
    corpus = regenerate(
        target,
        selection.prompts,
        out,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        layers=layers,
        source=args.source,
        selection={**source_info, **selection.describe()},
        max_prompt_tokens=max_prompt_tokens,
        show_progress=True,
        engine=engine,
    )
    _print_summary(out, corpus)
    return 0


def _engine_config(args: argparse.Namespace) -> GenerateConfig | None:
    """The engine's config for ``--drafter`` (None without it: the plain loop), after the
    checks that need no model: tokens only, a budget only with a drafter, known plugin names."""
    if args.drafter is None:
        if args.budget is not None:
            raise ConfigError("--budget needs --drafter (the plain loop drafts nothing)")
        return None
    if not args.no_features:
        raise ConfigError(
            "--drafter decodes tokens only: add --no-features (features need every token's states, "
            "which the plain loop captures; or run `jetflow data features` afterwards)"
        )
    fields: dict = {
        "target": args.target,
        "dtype": args.dtype,
        "drafter": args.drafter,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
    }
    if args.budget is not None:
        fields["tree"] = {"budget": args.budget}
    return build_config(GenerateConfig, fields)


def _training_samples(source: str) -> tuple[list[prompt_sets.Sample], dict]:
    """The training side of ``source`` (ShareGPT less its held-out split) and what it was."""
    if source != "sharegpt":
        return prompt_sets.load_dataset_samples(source), {}
    samples, report = prompt_sets.load_sharegpt_with_report()
    samples, heldout = prompt_sets.split_sharegpt(samples)
    info = {
        "file": report.path.name,
        "recovered": report.recovered,
        "dropped": report.dropped,
        "heldout": {"last": prompt_sets.SHAREGPT_HELDOUT_SIZE, "kept_for_eval": len(heldout)},
    }
    return samples, info


def _regenerate_second_turns(args: argparse.Namespace) -> int:
    """``--turn 2``: the follow-ups of the first-turn corpus, into its ``-turn2`` sibling."""
    samples, source_info = _training_samples(args.source)
    target = _load_target(args)
    layers = None if args.no_features else (args.layers or default_feature_layers(target.num_layers))
    parent = args.parent or corpus_dir_for(target.name)
    out = args.out or second_turn_dir(parent)
    corpus = second_turns.regenerate_second_turns(
        target,
        parent,
        out,
        {s.id: s for s in samples},
        exclude=prompt_sets.benchmark_prompt_texts(every_turn=True),
        follow=args.follow,
        limit=args.n,
        layers=layers,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens or second_turns.DEFAULT_MAX_PROMPT_TOKENS,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        source_info=source_info,
        show_progress=True,
    )
    _print_summary(out, corpus)
    return 0


def _print_summary(out: Path, corpus: Corpus | None) -> None:
    if corpus is None:
        print(f"{out}: nothing to answer yet")
        return
    counts, timing = corpus.manifest["counts"], corpus.manifest["regeneration"]
    print(
        f"{out}: {counts['n_conversations']} conversations, {counts['n_response_tokens']} response tokens, "
        f"{timing['wall_time_s']:.0f} s of generation, "
        f"{timing['response_tokens_per_s']:.1f} response tokens/s"
    )


def _corpora(args: argparse.Namespace, with_eval: bool = False) -> list[Corpus]:
    """The ``--corpus`` folders, else every corpus the trainer reads by default (``with_eval``:
    its held-out evaluation corpus too, where one exists)."""
    if args.corpus:
        return [Corpus(folder) for folder in args.corpus]
    evaluation = default_eval_corpus_dir() if with_eval else None
    return [Corpus(folder) for folder in [*training_corpus_dirs(), *([evaluation] if evaluation else [])]]


def _features(args: argparse.Namespace) -> int:
    corpora = _corpora(args, with_eval=True)
    target = _load_target(args)
    layers = args.layers or default_feature_layers(target.num_layers)
    for corpus in corpora:
        store = build_features(
            target,
            corpus,
            layers,
            token_budget=args.token_budget,
            part=args.part,
            limit=args.max_sequences,
            show_progress=True,
        )
        if store is None:
            k, n = args.part
            print(f"{corpus.path}: part {k}/{n} of the features done; the other parts are still missing")
        else:
            print(f"{store.folder}: features of layers {list(store.layers)} for {len(store)} sequences")
    return 0


def _stats(args: argparse.Namespace) -> int:
    corpora = _corpora(args)
    stats = combined_stats(corpora)
    if args.json:
        print(json.dumps(stats))
        return 0
    for corpus, part in zip(corpora, stats["corpora"], strict=True):
        timing = corpus.manifest.get("regeneration", {})
        print(f"corpus   {corpus.path}")
        for key, value in part.items():
            print(f"  {key:<18} {value}")
        print(f"  {'response tok/s':<18} {timing.get('response_tokens_per_s', 0)}")
    print(f"{'n_conversations':<20} {stats['n_conversations']}")
    print(f"{'n_sequences':<20} {stats['n_sequences']}")
    print(f"{'n_response_tokens':<20} {stats['n_response_tokens']}")
    return 0
