"""``swiftkv calibrate``: measure each served model's per-replica prefill rate (``serve_apps/calibrate.py``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from swiftkv.model_source import MODEL_HELP


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="measure a replica's prefill tokens/s and decode step time (the autoscaler's capacity figure; "
        "a fleet-simulator profile)",
        description="For each model of a serve config, start its vLLM engine as a replica would (same "
        "engine_kwargs, resources and environment, in a Ray task) and measure uncached prefill tokens/s "
        "and decode step time, and record the engine's KV capacity, token budget and start-up time. Writes a "
        "JSON profile (which `swiftkv fleet` reads) and prints the prefill_tokens_per_s line for the config. "
        "Run it on the hardware the replicas run on (`ray job submit -- swiftkv calibrate ...` on a cluster).",
    )
    p.add_argument("--model", action="append", default=[], metavar="[NAME=]MODEL", help=MODEL_HELP)
    p.add_argument("--config", help="a Serve config file from serve_apps/ (its models and their engine settings)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--input-lens", type=int, nargs="+", default=[512, 2048],
                   help="prompt lengths to measure (the longest gives prefill_tokens_per_s)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode batch sizes to measure")
    p.add_argument("--decode-contexts", type=int, nargs="+", default=[128, 1024],
                   help="context lengths at which decode steps of the largest batch are measured")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per prefill measurement")
    p.add_argument("--rounds", type=int, default=3, help="repetitions (medians reported)")
    p.add_argument("--side-by-side", type=int, default=1, metavar="N",
                   help="measure N copies of each replica at once on one node (the median of each figure): the "
                   "figures of N replicas sharing one host, which run slower together than one alone")
    p.add_argument("--out", default="artifacts/calibration.json", help="JSON profile to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from serve_apps.calibrate import calibrate, format_profile
    from serve_apps.local import read_app_config

    if min(args.input_lens + args.batches + args.decode_contexts + [args.num_prompts, args.rounds,
                                                                     args.side_by_side]) < 1:
        raise ValueError("--input-lens, --batches, --decode-contexts, --num-prompts, --rounds and --side-by-side "
                         "must be positive")
    config = read_app_config(args.config, args.model, args.set)
    profile = calibrate(config.models, args.input_lens, args.batches, args.num_prompts, args.rounds,
                        args.decode_contexts, args.side_by_side)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2) + "\n")
    print(format_profile(profile))
    print(f"wrote {out}")
    return 0
