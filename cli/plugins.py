"""``jetflow plugins``: list the installed drafters, tree policies and verifiers."""

from __future__ import annotations

import argparse
import json

from jetflow.core.registry import default_registry


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plugins", help="list installed plugins and where they come from")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    listing = default_registry().describe()
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    for kind, entries in listing.items():
        print(f"{kind.replace('_', ' ')}:")
        for entry in entries:
            print(f"  {entry['name']:<16} {entry['description']}  [{entry['distribution']}]")
    return 0
