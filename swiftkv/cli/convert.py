"""``swiftkv convert BASE OUT``: a base checkpoint to a SwiftKV checkpoint."""

from __future__ import annotations

import argparse

from swiftkv.model_source import MODEL_HELP


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="turn a base Llama/Mistral/Qwen2 checkpoint into a SwiftKV checkpoint",
        description="Load BASE (local folder, 'bundled', s3://... folder or hub id), add the SwiftKV weights "
        "initialised as in the paper (q_proj copies, group-mean k/v_proj, norm_swiftkv from layer c) and write "
        "OUT in the published SwiftKV layout (safetensors + config + tokenizer + chat template).",
    )
    p.add_argument("base", help="base " + MODEL_HELP)
    p.add_argument("out", help="output folder (must be empty or absent unless --overwrite)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--num-key-value-layers", type=int, help="cutoff c: layers that keep their own KV")
    where.add_argument("--cutoff", type=float, help="the paper's 'F SwiftKV': the share of layers whose prefill "
                       "is skipped, c = ceil(L (1 - F)); 0.5 gives c = L/2, 0.25 gives c = 3L/4 (default: 50%% "
                       "SwiftKV, as for a config without num_key_value_layers)")
    p.add_argument("--key-value-group-size", type=int, default=1, help="AcrossKV group size g (1 = off)")
    p.add_argument("--key-value-shift-layers", type=int, nargs="+", default=[], metavar="J",
                   help="token shift (docs/distillation.md): layers after the cutoff whose SwiftKV K/V also read "
                   "the cutoff state of the tokens before; starts at zero, for distillation (not served by vLLM yet)")
    p.add_argument("--key-value-shift-tokens", type=int, default=0, metavar="N",
                   help="how many tokens before each token those layers read (with --key-value-shift-layers)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from swiftkv.config import TokenShift
    from swiftkv.convert import convert_checkpoint
    from swiftkv.model_source import resolve_model

    out = convert_checkpoint(
        resolve_model(args.base), args.out, num_key_value_layers=args.num_key_value_layers,
        key_value_group_size=args.key_value_group_size, cutoff=args.cutoff, overwrite=args.overwrite,
        shift=TokenShift(tuple(args.key_value_shift_layers), args.key_value_shift_tokens),
    )
    print(out)
    return 0
