"""``swiftkv <verb>``: each verb lives in its own module of this package and is a thin call
into the library. A verb module exposes ``add_parser(subparsers)`` which registers the verb and
sets ``func`` (called with the parsed arguments). Verb modules import only light modules at the
top (no torch, transformers, Ray or vLLM), so ``--help`` and argument errors answer at once."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Verb modules, in the order `swiftkv --help` lists them.
VERB_MODULES = [
    "swiftkv.cli.convert",
    "swiftkv.cli.merge",
    "swiftkv.cli.generate",
    "swiftkv.cli.bundle",
    "swiftkv.cli.flops",
    "swiftkv.cli.simscore",
    "swiftkv.cli.serve",
    "swiftkv.cli.calibrate",
    "swiftkv.cli.fleet",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swiftkv",
        description="SwiftKV: convert, analyse, distil and serve prefill-skipping LLMs.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name in VERB_MODULES:
        importlib.import_module(name).add_parser(subparsers)
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
