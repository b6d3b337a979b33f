"""Plot the recovery curve of a distillation run: held-out KL to the teacher and top-1 agreement
against the optimizer step, from ``heldout_curve.json`` in the run's final checkpoint.

    python -m benchmarks.plot_distill_curve artifacts/distill/smollm2-135m-swiftkv-50/step_00000080 \
        --out artifacts/distill_curve.png

Step 0 is the rewired model with no distillation (the SPEC initialisation); the teacher itself is
KL 0 and agreement 1 by definition. Prints the curve as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from swiftkv.distill.train_loop import CURVE_FILE  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkpoint", type=Path, help="a checkpoint folder of the run (the last one has the full curve)"
    )
    parser.add_argument("--out", type=Path, default=Path("artifacts/distill_curve.png"))
    parser.add_argument("--title", default="SwiftKV knowledge recovery")
    args = parser.parse_args()

    curve = json.loads((args.checkpoint / CURVE_FILE).read_text())
    steps = [p["step"] for p in curve]
    fig, kl_axis = plt.subplots(figsize=(6, 3.6))
    kl_axis.plot(
        steps, [p["heldout_kl"] for p in curve], "o-", color="tab:red", label="held-out KL(teacher || student)"
    )
    kl_axis.set_xlabel("optimizer step")
    kl_axis.set_ylabel("KL per token (nats)", color="tab:red")
    kl_axis.set_ylim(bottom=0)
    agree_axis = kl_axis.twinx()
    agree_axis.plot(steps, [p["heldout_top1"] for p in curve], "s--", color="tab:blue", label="top-1 agreement")
    agree_axis.set_ylabel("top-1 agreement with teacher", color="tab:blue")
    agree_axis.set_ylim(0, 1)
    kl_axis.set_title(args.title)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    args.out.with_suffix(".json").write_text(json.dumps(curve, indent=1))

    print("| step | held-out KL | top-1 agreement | tokens |")
    print("| --- | --- | --- | --- |")
    for p in curve:
        print(f"| {p['step']} | {p['heldout_kl']:.4f} | {p['heldout_top1']:.3f} | {p['heldout_tokens']} |")
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
