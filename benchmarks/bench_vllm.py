"""vLLM serving: the base model, SwiftKV and SwiftKV + AcrossKV on the same weights, side by side.

Three in-process engines (base checkpoint served by vLLM's own model; the SwiftKV conversion at
``--cutoff``; the same with AcrossKV group size ``--group-size``) take turns: every measurement is
repeated ``--rounds`` times, interleaved across the engines; the report gives the median and the
median of the per-round ratios to the base. Measured:
- offline throughput, (input + output tokens) / s, for every input length x output length, with
  ``--num-prompts`` prompts submitted at once;
- TTFT and TPOT with requests arriving at a fixed rate (``--rate`` per second, evenly spaced);
- the KV cache capacity (tokens) each engine gets from the same memory.
The weights are the conversion's initial weights (no distillation): speed does not depend on them.
Prompts are random token ids, distinct per request and round, with prefix caching off.

CPU (2 cores here; the bundled SmolLM2-135M-Instruct at 50%):
    .venv/bin/python benchmarks/bench_vllm.py --model smollm2 --input-lens 512 2048 \\
        --output-lens 1 16 --out artifacts/bench_vllm/smollm2
GPU (unchanged script; engines share the GPU):
    python benchmarks/bench_vllm.py --model /path/to/Llama-3.1-8B-Instruct --memory-fraction 0.28
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

log = logging.getLogger("bench_vllm")

# A larger random Llama for CPU runs: 16 layers, hidden 1024 (~0.25B parameters), GQA 16/4 heads.
RANDOM_LLAMA = dict(
    vocab_size=49152, hidden_size=1024, intermediate_size=3584, num_hidden_layers=16,
    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=16384,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)


@dataclass
class Variant:
    name: str
    path: Path
    kv_tokens: int = 0
    throughput: dict[str, list[float]] = field(default_factory=dict)  # "in x out" -> tok/s per round
    ttft: list[float] = field(default_factory=list)  # seconds, median over the requests of each round
    tpot: list[float] = field(default_factory=list)


def prepare_models(model: str, work: Path, cutoff: float, group_size: int | None) -> list[Variant]:
    """The base folder and its two SwiftKV conversions (cached in ``work``)."""
    from transformers import AutoConfig

    from swiftkv.bundled import copy_bundled_tokenizer, ensure_bundled_model
    from swiftkv.config import cutoff_from_fraction
    from swiftkv.convert import convert_checkpoint

    if model == "smollm2":
        base = ensure_bundled_model()
    elif model == "random-llama":
        base = work / "random-llama"
        if not (base / "config.json").exists():
            from transformers import LlamaConfig, LlamaForCausalLM

            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(**RANDOM_LLAMA)).to(torch.bfloat16).save_pretrained(base)
            copy_bundled_tokenizer(base)
    else:
        base = Path(model)
    num_layers = AutoConfig.from_pretrained(base).num_hidden_layers
    c = cutoff_from_fraction(num_layers, cutoff)
    g = group_size or next(d for d in range(2, num_layers - c + 1) if (num_layers - c) % d == 0)
    variants = [Variant("base", base)]
    for name, size in ((f"swiftkv c={c}", 1), (f"swiftkv c={c} + acrosskv g={g}", g)):
        out = work / f"{base.name}-swiftkv-c{c}-g{size}"
        if not (out / "config.json").exists():
            convert_checkpoint(str(base), out, num_key_value_layers=c, key_value_group_size=size, overwrite=True)
        variants.append(Variant(name, out))
    return variants


def fit_input_lens(args: argparse.Namespace, base: Path) -> list[int]:
    """Input lengths that fit the model's context with the longest output (and 8 spare tokens):
    longer ones are cut to fit, and the report names the length actually run."""
    from transformers import AutoConfig

    context = AutoConfig.from_pretrained(base).max_position_embeddings
    longest = context - max(args.output_lens + [args.latency_output_len]) - 8
    if args.latency_input_len > longest:
        raise SystemExit(f"--latency-input-len {args.latency_input_len} does not fit the context of {context}")
    fitted = []
    for n in args.input_lens:
        if n > longest:
            log.warning("input length %d + outputs exceed the model's %d positions: running %d", n, context, longest)
            n = longest
        if n not in fitted:
            fitted.append(n)
    return fitted


def start_engine(variant: Variant, args: argparse.Namespace):
    from vllm import LLM

    llm = LLM(
        model=str(variant.path),
        dtype=args.dtype,
        max_model_len=max(args.input_lens + [args.latency_input_len]) + max(args.output_lens) + 8,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.memory_fraction,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        seed=0,
    )
    cache = llm.llm_engine.vllm_config.cache_config
    variant.kv_tokens = cache.num_gpu_blocks * cache.block_size
    return llm


class PromptMaker:
    """Random prompts, never repeated, the same sequence for every engine of a round."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.seed = vocab, seed

    def batch(self, key: int, count: int, length: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
        return torch.randint(10, self.vocab, (count, length), generator=gen).tolist()


def _params(output_len: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # Cumulative outputs at every step, so the first token's time is seen when it is made.
    return SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.CUMULATIVE
    )


def offline_throughput(llm, prompts: list[list[int]], output_len: int) -> float:
    """(input + output) tokens/s for all prompts submitted at once."""
    from vllm import TokensPrompt

    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], _params(output_len), use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs) / elapsed


def fixed_rate_latency(llm, prompts: list[list[int]], output_len: int, rate: float, tag: str):
    """TTFT and TPOT (seconds) of requests arriving every ``1 / rate`` seconds, served by stepping
    the in-process engine (so no client process competes with the engine for the cores)."""
    from vllm import TokensPrompt

    engine = llm.llm_engine
    start = time.perf_counter()
    arrivals = [start + i / rate for i in range(len(prompts))]
    next_request, ids = 0, {}
    first: dict[int, float] = {}
    ttft, tpot, finished = [], [], 0
    while finished < len(prompts):
        now = time.perf_counter()
        while next_request < len(prompts) and arrivals[next_request] <= now:
            prompt = TokensPrompt(prompt_token_ids=prompts[next_request])
            ids[f"{tag}-{next_request}"] = next_request  # outputs carry the id given here
            engine.add_request(f"{tag}-{next_request}", prompt, _params(output_len))
            next_request += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[next_request] - now))
            continue
        for out in engine.step():
            i, now = ids[out.request_id], time.perf_counter()
            if i not in first and out.outputs[0].token_ids:
                first[i] = now
                ttft.append(now - arrivals[i])
            if out.finished:
                finished += 1
                if len(out.outputs[0].token_ids) > 1:
                    tpot.append((now - first[i]) / (len(out.outputs[0].token_ids) - 1))
    return ttft, tpot


def benchmark(args: argparse.Namespace, variants: list[Variant]) -> None:
    engines = [start_engine(v, args) for v in variants]
    prompts = PromptMaker(args.vocab_limit, seed=0)
    cells = [(i, o) for i in args.input_lens for o in args.output_lens]
    for llm in engines:  # warm-up: first-step kernel set-up is not part of any figure
        offline_throughput(llm, prompts.batch(-1, 2, 64), 2)
    steps = tqdm(total=args.rounds * (len(cells) + 1) * len(variants), desc="bench_vllm", unit="run")
    for round_ in range(args.rounds):
        for key, (input_len, output_len) in enumerate(cells):
            batch = prompts.batch(round_ * 100 + key, args.num_prompts, input_len)
            for variant, llm in zip(variants, engines, strict=True):
                variant.throughput.setdefault(f"{input_len}x{output_len}", []).append(
                    offline_throughput(llm, batch, output_len)
                )
                steps.update()
        batch = prompts.batch(round_ * 100 + 99, args.latency_requests, args.latency_input_len)
        for variant, llm in zip(variants, engines, strict=True):
            ttft, tpot = fixed_rate_latency(llm, batch, args.latency_output_len, args.rate, f"lat{round_}")
            variant.ttft.append(statistics.median(ttft))
            variant.tpot.append(statistics.median(tpot))
            steps.update()
    steps.close()


def _paired_ratio(values: list[float], base: list[float]) -> float:
    """Median over rounds of (variant / base) within each round: slow drifts of a shared machine
    cancel within a round."""
    return statistics.median(v / b for v, b in zip(values, base, strict=True))


def summarize(variants: list[Variant], args: argparse.Namespace) -> dict:
    base = variants[0]
    rows = []
    for cell in base.throughput:
        row = {"cell": cell}
        for v in variants:
            row[v.name] = statistics.median(v.throughput[cell])
            row[f"{v.name} / base"] = _paired_ratio(v.throughput[cell], base.throughput[cell])
        rows.append(row)
    latency = {
        v.name: {
            "ttft_median_s": statistics.median(v.ttft),
            "tpot_median_s": statistics.median(v.tpot),
            "ttft_ratio": _paired_ratio(v.ttft, base.ttft),
            "tpot_ratio": _paired_ratio(v.tpot, base.tpot),
        }
        for v in variants
    }
    capacity = {v.name: {"kv_tokens": v.kv_tokens, "ratio": v.kv_tokens / base.kv_tokens} for v in variants}
    return {"args": {k: str(val) for k, val in vars(args).items()}, "throughput_tok_s": rows,
            "latency": latency, "kv_capacity": capacity, "raw": [asdict(v) | {"path": str(v.path)} for v in variants]}


def print_report(result: dict, variants: list[Variant]) -> None:
    names = [v.name for v in variants]
    print("\nOffline throughput, (input + output) tokens/s, median of rounds (median per-round ratio to base)")
    print(f"{'input x output':>15} | " + " | ".join(f"{n:>34}" for n in names))
    for row in result["throughput_tok_s"]:
        cells = [f"{row[n]:>25.1f} ({row[f'{n} / base']:.2f}x)" for n in names]
        print(f"{row['cell']:>15} | " + " | ".join(cells))
    args = result["args"]
    print(f"\nFixed rate {args['rate']}/s, {args['latency_input_len']} in / {args['latency_output_len']} out:")
    for n in names:
        lat = result["latency"][n]
        print(f"  {n:>34}: TTFT {lat['ttft_median_s'] * 1e3:8.1f} ms ({lat['ttft_ratio']:.2f}x)   "
              f"TPOT {lat['tpot_median_s'] * 1e3:7.1f} ms ({lat['tpot_ratio']:.2f}x)")
    print("\nKV cache capacity in the same memory:")
    for n in names:
        cap = result["kv_capacity"][n]
        print(f"  {n:>34}: {cap['kv_tokens']:>9} tokens ({cap['ratio']:.2f}x)")


def plot(result: dict, variants: list[Variant], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["throughput_tok_s"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        ax.bar([x + i * width for x in range(len(rows))], [r[f"{v.name} / base"] for r in rows], width, label=v.name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([x + width * (len(variants) - 1) / 2 for x in range(len(rows))], [r["cell"] for r in rows])
    ax.set_xlabel("input tokens x output tokens")
    ax.set_ylabel("throughput / base")
    ax.set_title(f"vLLM throughput vs base: {Path(result['args']['model']).name}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (bundled), 'random-llama' (16 layers, hidden 1024) or a base HF folder")
    parser.add_argument("--cutoff", type=float, default=0.5, help="fraction of layers that keep their own KV")
    parser.add_argument("--group-size", type=int, default=None,
                        help="AcrossKV group size (default: the smallest that divides L - c)")
    parser.add_argument("--input-lens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--output-lens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts per throughput measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions (median reported)")
    parser.add_argument("--rate", type=float, default=1.0, help="request rate for TTFT/TPOT (requests/s)")
    parser.add_argument("--latency-requests", type=int, default=16)
    parser.add_argument("--latency-input-len", type=int, default=2048)
    parser.add_argument("--latency-output-len", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default="auto", help="e.g. fp8 (stacks with AcrossKV)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--memory-fraction", type=float, default=0.28,
                        help="GPU memory per engine (three engines share the GPU); on CPU see --kv-cache-gib")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="CPU only: KV cache per engine")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile / CUDA graphs")
    parser.add_argument("--vocab-limit", type=int, default=32000, help="prompt token ids are drawn below this")
    parser.add_argument("--work-dir", type=Path, default=Path(".cache/bench_vllm"), help="converted checkpoints")
    parser.add_argument("--out", type=Path, default=Path("artifacts/bench_vllm"), help="results.json and plot")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # In-process engines: on few cores a separate engine process competes with the worker's threads.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

    variants = prepare_models(args.model, args.work_dir, args.cutoff, args.group_size)
    args.input_lens = fit_input_lens(args, variants[0].path)
    benchmark(args, variants)
    result = summarize(variants, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    plot(result, variants, args.out / "throughput_ratio.png")
    print_report(result, variants)
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'throughput_ratio.png'}")


if __name__ == "__main__":
    main()
