"""``swiftkv flops CONFIG``: the prefill FLOPs, KV-cache and trainable-parameter model of SwiftKV."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from swiftkv.analysis.flops import (
    BASE_KV_CACHE_DTYPE,
    KV_CACHE_DTYPE_BYTES,
    flops_report,
    load_config,
)
from swiftkv.config import cutoff_from_fraction

PARTS = [
    ("vocab", "vocabulary (embedding + LM head)"),
    ("kv_proj", "K/V projections"),
    ("qo_proj", "Q/O projections"),
    ("mlp", "MLP"),
    ("attention", "attention"),
    ("total", "total"),
]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "flops",
        help="predicted prefill FLOPs, KV-cache bytes and trainable parameters of a SwiftKV layout",
        description=(
            "Analytic cost model from a model config alone: GFLOPs per prompt token by part for the base "
            "model and for SwiftKV, the predicted prefill-time ratio, KV-cache bytes per token and the "
            "distillation's trainable-parameter count. Attention is averaged over a causal prefill of "
            "--seq-len tokens; the paper's Llama-3.1-70B table corresponds to --seq-len 122880."
        ),
    )
    parser.add_argument("config", help="config.json path, model folder, (cached) hub id, or bundled / bundled-swiftkv")
    parser.add_argument("--seq-len", type=int, required=True, help="prompt length in tokens")
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument(
        "--cutoff",
        type=float,
        help="share of layers prompt tokens skip, as in '50%% SwiftKV' = 0.5 (c = L * (1 - F))",
    )
    layout.add_argument("--num-key-value-layers", type=int, help="the cutoff layer c directly")
    parser.add_argument(
        "--key-value-group-size",
        type=int,
        default=None,
        help="AcrossKV group size g (default: the config's, else 1)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=sorted(KV_CACHE_DTYPE_BYTES),
        default=BASE_KV_CACHE_DTYPE,
        help=f"SwiftKV's KV-cache dtype; reductions are against the base model's {BASE_KV_CACHE_DTYPE} cache",
    )
    parser.add_argument("--json", type=Path, help="also write the numbers to this JSON file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    config = load_config(args.config)
    c = args.num_key_value_layers
    if args.cutoff is not None:
        c = cutoff_from_fraction(config.num_hidden_layers, args.cutoff)
    report = flops_report(config, args.seq_len, c, args.key_value_group_size, args.kv_cache_dtype)
    print(format_report(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def format_report(r: dict) -> str:
    L, c, g = r["num_hidden_layers"], r["num_key_value_layers"], r["key_value_group_size"]
    base, swift = r["prefill_gflops_per_token"]["base"], r["prefill_gflops_per_token"]["swiftkv"]
    kv, params = r["kv_cache_bytes_per_token"], r["params"]
    lines = [
        f"{r['model_type']}, {L} layers, prompt of {r['seq_len']} tokens; SwiftKV c={c} "
        f"({(L - c) / L:.1%} of layers skipped), AcrossKV g={g}",
        f"{'GFLOPs per prompt token':<34}{'base':>10}{'SwiftKV':>10}",
    ]
    lines += [f"  {label:<32}{base[key]:>10.4g}{swift[key]:>10.4g}" for key, label in PARTS]
    lines += [
        f"prefill FLOPs reduction: {r['prefill_flops_reduction']:.1%}; predicted prefill time ratio "
        f"(vocab excluded): {r['predicted_prefill_ratio']:.3f}",
        f"KV cache per token: base {kv['base']:,} B ({kv['base_dtype']}), SwiftKV {kv['swiftkv']:,} B "
        f"({kv['swiftkv_dtype']}): {r['kv_cache_reduction']:.2%} less",
        f"trainable parameters: {params['trainable']:,} of {params['total']:,} ({params['trainable_share']:.2%})",
    ]
    return "\n".join(lines)
