"""``swiftkv simscore MODEL``: layer similarity (the paper's SimScore) and cutoff suggestions."""

from __future__ import annotations

import argparse

from swiftkv.bundled import BUNDLED
from swiftkv.config import DEFAULT_SIMSCORE_THRESHOLD
from swiftkv.model_source import MODEL_HELP


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simscore",
        help="layer similarity (SimScore) of a model on chat data, with suggested cutoffs",
        description=(
            "Run chat-templated conversations through MODEL (any causal LM folder; SwiftKV checkpoints "
            "run as their teacher) and measure the mean cosine similarity between every pair of layer "
            "inputs. SimScore(l) is the mean similarity of layer l's input to every later layer's input. "
            "Writes simscore.json, simscore.png and similarity.png, and prints the curve and suggested "
            "cutoffs (rule in swiftkv/analysis/simscore.py)."
        ),
    )
    parser.add_argument("model", help=MODEL_HELP)
    parser.add_argument(
        "--data",
        default=BUNDLED,
        help=f"chat data: .jsonl/.json/.parquet with 'messages' or 'conversations' rows, or '{BUNDLED}' "
        "(the bundled chitchat conversations; default)",
    )
    parser.add_argument("--num-samples", type=int, default=64, help="conversations to use (default 64)")
    parser.add_argument("--max-len", type=int, default=512, help="tokens per conversation, truncated (default 512)")
    parser.add_argument("--batch-size", type=int, default=4, help="conversations per forward pass (default 4)")
    parser.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_SIMSCORE_THRESHOLD,
        help=f"SimScore a cutoff should clear (default {DEFAULT_SIMSCORE_THRESHOLD}, the paper's half-depth level)",
    )
    parser.add_argument("--out", default="artifacts/simscore", help="output folder (default artifacts/simscore)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from swiftkv.analysis.simscore import compute_simscore, save_result

    result = compute_simscore(args.model, args.data, args.num_samples, args.max_len, args.batch_size, args.threshold)
    paths = save_result(result, args.out)
    print(f"{result.num_samples} conversations, {result.num_tokens} tokens")
    print("SimScore(l): " + " ".join(f"{i}:{s:.2f}" for i, s in enumerate(result.simscore)))
    for t in result.targets:
        flag = "  BELOW THRESHOLD" if t.below_threshold else ""
        print(f"{t.share:.0%} SwiftKV: c={t.num_key_value_layers}, SimScore={t.simscore:.3f}{flag}")
    print(f"recommended cutoff (threshold {result.threshold}): {result.recommended_num_key_value_layers}")
    print("wrote " + ", ".join(str(p) for p in paths))
