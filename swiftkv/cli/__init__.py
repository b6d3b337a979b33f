"""``swiftkv <verb>``: each verb lives in its own module and is a thin call into the code that
does the work. A verb module exposes ``add_parser(subparsers)`` which registers the verb and sets
``func`` (called with the parsed arguments). Verb modules import only light modules at the top (no
torch, transformers, Ray or vLLM), so ``--help`` and argument errors answer at once.

The library's verbs are modules of this package. Verbs that build on an application (the Serve
app's ``serve``, ``calibrate`` and ``fleet``, in ``serve_apps/cli/``) come in through the
``swiftkv.verbs`` entry-point group, each naming its ``add_parser``: the library never imports an
application, and the one command still lists every verb."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable
from typing import Any

# The library's verb modules, in the order `swiftkv --help` lists them (the entry points' verbs follow).
VERB_MODULES = [
    "swiftkv.cli.convert",
    "swiftkv.cli.merge",
    "swiftkv.cli.generate",
    "swiftkv.cli.bundle",
    "swiftkv.cli.flops",
    "swiftkv.cli.simscore",
]
VERB_GROUP = "swiftkv.verbs"  # where packages built on the library add verbs


def verb_adders() -> list[Callable[[Any], None]]:
    """Every verb's ``add_parser``: this package's, then the entry points' (in their declared order)."""
    from importlib.metadata import entry_points

    return ([importlib.import_module(name).add_parser for name in VERB_MODULES]
            + [entry.load() for entry in entry_points(group=VERB_GROUP)])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swiftkv",
        description="SwiftKV: convert, analyse, distil and serve prefill-skipping LLMs.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for add_parser in verb_adders():
        add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as err:
        if args.debug:
            raise
        # Bad input: one clear line, no traceback (--debug shows it).
        print(f"swiftkv {args.verb}: error: {err} (--debug shows the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
