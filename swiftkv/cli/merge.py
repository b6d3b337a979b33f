"""``swiftkv merge CHECKPOINT OUT``: a distillation checkpoint's SwiftKV tensors into a full checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "merge",
        help="turn an intermediate distillation checkpoint into a full SwiftKV checkpoint",
        description="Distillation checkpoints keep only what training changes: the SwiftKV tensors, the "
        "student's config and a pointer to the starting model (their swiftkv/ folder); only the last one also "
        "holds the full model. This writes OUT, the full SPEC checkpoint of CHECKPOINT (a step_* folder or its "
        "swiftkv/ folder): the starting model's weights (its shards copied as they are) and the trained SwiftKV "
        "tensors, loadable by from_pretrained and vLLM.",
    )
    p.add_argument("checkpoint", help="a distillation checkpoint folder (step_*) or its swiftkv/ folder")
    p.add_argument("out", help="output folder (must be empty or absent)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from swiftkv.distill.model_io import merge_swiftkv_part

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output folder {out} exists and is not empty")
    print(merge_swiftkv_part(args.checkpoint, out))
    return 0
