"""``jetflow`` command line: each module of this package beside this one is a subcommand.

A subcommand module defines ``register(subparsers)`` (adding its parser with
``set_defaults(run=...)``) and a ``run(args) -> int``. Errors a user can fix
(:class:`JetflowError`) become one line on stderr and exit code 2; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys

from jetflow.core.errors import JetflowError

from jetflow import __version__

EXIT_USER_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetflow", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"jetflow {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    package = importlib.import_module("jetflow.cli")
    for module_info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if module_info.name.startswith("_") or module_info.name == "main":
            continue
        module = importlib.import_module(f"jetflow.cli.{module_info.name}")
        module.register(subparsers)
    return parser


def _quiet_libraries() -> None:
    """Keep library chatter (load bars, deprecation notes) off the user's terminal."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )
    _quiet_libraries()
    try:
        return int(args.run(args) or 0)
    except JetflowError as error:
        print(f"jetflow: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("jetflow: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
