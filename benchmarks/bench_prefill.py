"""Prefill time of the SwiftKV student against its teacher in Hugging Face, side by side.

For each model and prompt length, the teacher (SwiftKV off) and the students at each cutoff run
the generate-style prefill (a cache, ``logits_to_keep=1``) in interleaved rounds; the table gives
the median student/teacher time ratio beside the FLOPs model's prediction. Models: the bundled
SmolLM2-135M-Instruct and the random Llamas of ``swiftkv/random_llama.py`` (the 8B-shaped one
needs a GPU; models run on the GPU when there is one). Ratios, not absolute times, are the result:
timings on a shared CPU are noisy.

    .venv/bin/python -m benchmarks.bench_prefill --out artifacts/bench_prefill
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from swiftkv.analysis.flops import predicted_prefill_ratio
from swiftkv.bundled import ensure_bundled_model
from swiftkv.config import cutoff_from_fraction
from swiftkv.convert import convert_model
from swiftkv.random_llama import SHAPES, random_llama

log = logging.getLogger("bench_prefill")

def load_models(which: str, dtype: torch.dtype, device: torch.device):
    if which == "smollm2":
        return AutoModelForCausalLM.from_pretrained(ensure_bundled_model(), dtype=dtype).to(device).eval()
    return random_llama(dtype, which, device)


def prefill_seconds(model, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        model(ids, use_cache=True, logits_to_keep=1)
    if ids.is_cuda:  # kernels run asynchronously: wait for them
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_model(name: str, base, fractions: list[float], lengths: list[int], rounds: int) -> list[dict]:
    num_layers = base.config.num_hidden_layers
    variants = {"teacher": base}
    for f in fractions:  # f = share of layers whose prefill SwiftKV skips ("50% SwiftKV")
        variants[f"{round(f * 100)}%"] = convert_model(base, cutoff_from_fraction(num_layers, f))
    rows = []
    for length in lengths:
        ids = torch.randint(10, base.config.vocab_size, (1, length),
                            generator=torch.Generator().manual_seed(length)).to(base.device)
        for model in variants.values():  # warm-up
            prefill_seconds(model, ids)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in tqdm(range(rounds), desc=f"{name} {length} tokens", leave=False):
            for key, model in variants.items():  # interleaved: drift hits every variant alike
                times[key].append(prefill_seconds(model, ids))
        teacher = statistics.median(times["teacher"])
        for key, model in variants.items():
            if key == "teacher":
                continue
            c = model.config.num_key_value_layers
            rows.append(dict(
                model=name, prompt_tokens=length, swiftkv=key, num_key_value_layers=c, num_layers=num_layers,
                teacher_s=teacher, student_s=statistics.median(times[key]),
                measured_ratio=statistics.median(times[key]) / teacher,
                predicted_ratio=predicted_prefill_ratio(base.config, length, c, 1),
                teacher_tok_s=length / teacher,
            ))
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models, strict=True):
        for key in sorted({r["swiftkv"] for r in rows if r["model"] == name}):
            sel = [r for r in rows if r["model"] == name and r["swiftkv"] == key]
            xs = [r["prompt_tokens"] for r in sel]
            line = ax.plot(xs, [r["measured_ratio"] for r in sel], "o-", label=f"{key} measured")[0]
            ax.plot(xs, [r["predicted_ratio"] for r in sel], "--", color=line.get_color(), label=f"{key} FLOPs model")
        ax.set(title=f"{name}: prefill time, SwiftKV / teacher", xlabel="prompt tokens", ylabel="time ratio",
               xscale="log", ylim=(0, 1.05))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2", "random-llama"], choices=["smollm2", *SHAPES])
    p.add_argument("--fractions", nargs="+", type=float, default=[0.25, 0.5, 0.75],
                   help="SwiftKV fractions: the share of layers whose prefill is skipped")
    p.add_argument("--lengths", nargs="+", type=int, default=[256, 1024, 2048])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--out", default="artifacts/bench_prefill")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for name in args.models:
        rows += bench_model(name, load_models(name, dtype, device), args.fractions, args.lengths, args.rounds)
    meta = dict(dtype=args.dtype, rounds=args.rounds, device=torch.cuda.get_device_name() if device.type == "cuda"
                else f"cpu, {torch.get_num_threads()} threads")
    (out / "prefill.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, out / "prefill.png")
    print("| model | prompt tokens | SwiftKV | c/L | teacher tok/s | measured time ratio | FLOPs model |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['prompt_tokens']} | {r['swiftkv']} | {r['num_key_value_layers']}/{r['num_layers']} "
              f"| {r['teacher_tok_s']:.0f} | {r['measured_ratio']:.3f} | {r['predicted_ratio']:.3f} |")
    print(f"\nwrote {out / 'prefill.json'} and {out / 'prefill.png'}")


if __name__ == "__main__":
    main()
