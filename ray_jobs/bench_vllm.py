"""vLLM serving benchmark: the base model, SwiftKV and SwiftKV + AcrossKV on the same weights.

Three engines (the base checkpoint served by vLLM's own model; its SwiftKV conversion at
``cutoff``; the same with AcrossKV group size ``group_size``), and with ``no_skip_control`` a fourth
(the SwiftKV conversion with prefill skipping off), take turns: every measurement is
repeated ``rounds`` times, interleaved across the engines, and the report gives the median and the
median of the per-round ratios to the base (slow drifts of a shared machine cancel within a round).
Measured:
- offline throughput, (input + output tokens) / s, for every input length x output length, with
  ``num_prompts`` prompts submitted at once;
- TTFT and TPOT of requests arriving at a fixed rate (``rate`` per second, evenly spaced);
- the KV cache capacity (tokens) each engine gets from the same memory.
The weights are the conversion's initial weights (no distillation): speed does not depend on them.
Prompts are random token ids, distinct per request and round, with prefix caching off.

``ray_jobs/benchmark.py`` runs this as a Ray job; the engines live in-process in one Ray task.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator
from tqdm import tqdm

from serve_apps.offline_timing import PromptMaker, offline_throughput, sampling_params
from swiftkv.outputs import figure_png
from swiftkv.yaml_config import StrictConfig

log = logging.getLogger(__name__)

class ServingBenchConfig(StrictConfig):
    """One benchmark run (``ray_jobs/configs/bench-*.yaml``); defaults are the issue's matrix."""

    model: str = "bundled"
    """Base checkpoint: ``bundled`` (SmolLM2-135M-Instruct), ``random-llama`` (``swiftkv/random_llama.py``),
    a local folder, a hub id or an ``s3://`` folder."""

    cutoff: float = Field(default=0.5, gt=0, lt=1)
    """SwiftKV fraction F: layers ``>= c = ceil(L (1 - F))`` skip the prompt tokens."""

    group_size: int | None = Field(default=None, gt=1)
    """AcrossKV group size of the third engine (default: the smallest that divides ``L - c``)."""

    input_lens: list[int] = Field(default=[512, 2048, 8192], min_length=1)
    """Prompt lengths (tokens); lengths that do not fit the model's context with the longest output
    are cut to fit, and the report names the length actually run."""

    output_lens: list[int] = Field(default=[1, 16, 256], min_length=1)
    """Generated tokens per prompt (1 = prefill only)."""

    num_prompts: int = Field(default=16, gt=0)
    """Prompts per throughput measurement, submitted at once."""

    rounds: int = Field(default=3, gt=0)
    """Interleaved repetitions of every measurement (medians reported)."""

    rate: float = Field(default=1.0, gt=0)
    """Request rate (per second) for the TTFT/TPOT measurement."""

    latency_requests: int = Field(default=16, gt=0)
    """Requests per TTFT/TPOT measurement."""

    latency_input_len: int = Field(default=2048, gt=0)
    """Prompt length of the TTFT/TPOT requests."""

    latency_output_len: int = Field(default=64, gt=1)
    """Generated tokens of the TTFT/TPOT requests (TPOT needs at least two)."""

    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Weights and activations."""

    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """KV cache dtype (``fp8`` stacks with AcrossKV)."""

    max_num_batched_tokens: int = Field(default=8192, gt=0)
    """Tokens per engine step (longer prompts are prefilled in chunks)."""

    enforce_eager: bool = False
    """No torch.compile or CUDA graphs (quicker to start, slower to run)."""

    tensor_parallel_size: int = Field(default=1, gt=0)
    """GPUs (or CPU ranks) per engine."""

    use_gpu: bool = False
    """Run on a GPU node: the task reserves ``tensor_parallel_size`` GPUs."""

    gpu_memory_fraction: float = Field(default=0.28, gt=0, le=0.33)
    """GPU memory per engine (the engines share the GPUs; at most 0.24 with ``no_skip_control``)."""

    no_skip_control: bool = False
    """Also serve the SwiftKV conversion with prefill skipping off (every token runs every layer, as
    in the base): its ratio to the base is our model code against vLLM's own, so the SwiftKV ratio
    over this one is what the skipping alone buys."""

    cpu_kv_cache_gib: int = Field(default=2, gt=0)
    """CPU only: KV cache per engine (GiB)."""

    cpus: float = Field(default=2, gt=0)
    """Logical CPUs the benchmark task reserves (on CPU: the cores the engines compute on)."""

    vocab_limit: int = Field(default=32000, gt=10)
    """Prompt token ids are drawn from ``[10, vocab_limit)``."""

    work_dir: str = ".cache/bench_vllm"
    """Where the converted checkpoints are cached (on the node that runs the benchmark)."""

    out: str = "artifacts/bench_vllm"
    """Folder or ``s3://`` prefix for ``results.json``, ``report.txt`` and ``throughput_ratio.png``."""

    @model_validator(mode="after")
    def _engines_fit_the_gpu(self) -> ServingBenchConfig:
        engines = 4 if self.no_skip_control else 3
        if self.use_gpu and self.gpu_memory_fraction * engines > 0.99:
            raise ValueError(f"gpu_memory_fraction {self.gpu_memory_fraction} x {engines} engines exceeds the GPU")
        return self


@dataclass
class Variant:
    name: str
    path: Path
    prefill_skipping: bool = True
    kv_tokens: int = 0
    throughput: dict[str, list[float]] = field(default_factory=dict)  # "in x out" -> tok/s per round
    ttft: list[float] = field(default_factory=list)  # seconds, median over the requests of each round
    tpot: list[float] = field(default_factory=list)


def prepare_models(cfg: ServingBenchConfig) -> list[Variant]:
    """The base folder and its two SwiftKV conversions (cached in ``work_dir``), plus the no-skip
    control when asked for."""
    from transformers import AutoConfig

    from swiftkv.bundled import copy_bundled_tokenizer
    from swiftkv.config import cutoff_from_fraction
    from swiftkv.convert import convert_checkpoint
    from swiftkv.file_modes import make_readable
    from swiftkv.model_source import resolve_model
    from swiftkv.random_llama import NAME as RANDOM_LLAMA
    from swiftkv.random_llama import random_llama

    work = Path(cfg.work_dir)
    if cfg.model == RANDOM_LLAMA:
        base = work / RANDOM_LLAMA
        if not (base / "config.json").exists():
            random_llama(torch.bfloat16).save_pretrained(base)
            copy_bundled_tokenizer(base)
            make_readable(base)
    else:
        base = Path(resolve_model(cfg.model))
    num_layers = AutoConfig.from_pretrained(base).num_hidden_layers
    c = cutoff_from_fraction(num_layers, cfg.cutoff)
    g = cfg.group_size or next(d for d in range(2, num_layers - c + 1) if (num_layers - c) % d == 0)
    if (num_layers - c) % g:
        raise ValueError(f"group_size {g} does not divide the {num_layers - c} layers after the cutoff c={c}")
    variants = [Variant("base", base)]
    for name, size in ((f"swiftkv c={c}", 1), (f"swiftkv c={c} + acrosskv g={g}", g)):
        out = work / f"{base.name}-swiftkv-c{c}-g{size}"
        if not (out / "config.json").exists():
            log.info("converting %s -> %s", base, out)
            convert_checkpoint(str(base), out, num_key_value_layers=c, key_value_group_size=size, overwrite=True)
        variants.append(Variant(name, out))
    if cfg.no_skip_control:
        variants.append(Variant(f"swiftkv c={c}, no skipping", variants[1].path, prefill_skipping=False))
    return variants


def fit_input_lens(cfg: ServingBenchConfig, base: Path) -> list[int]:
    """Input lengths that fit the model's context with the longest output (and 8 spare tokens):
    longer ones are cut to fit."""
    from transformers import AutoConfig

    context = AutoConfig.from_pretrained(base).max_position_embeddings
    longest = context - max(cfg.output_lens + [cfg.latency_output_len]) - 8
    if cfg.latency_input_len > longest:
        raise ValueError(f"latency_input_len {cfg.latency_input_len} does not fit the model's {context} positions")
    fitted = []
    for n in cfg.input_lens:
        if n > longest:
            log.warning("input length %d + outputs exceed the model's %d positions: running %d", n, context, longest)
            n = longest
        if n not in fitted:
            fitted.append(n)
    return fitted


def start_engine(variant: Variant, cfg: ServingBenchConfig, max_model_len: int):
    from vllm import LLM

    llm = LLM(
        model=str(variant.path),
        dtype=cfg.dtype,
        max_model_len=max_model_len,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        enable_prefix_caching=False,
        enforce_eager=cfg.enforce_eager,
        gpu_memory_utilization=cfg.gpu_memory_fraction,
        kv_cache_dtype=cfg.kv_cache_dtype,
        tensor_parallel_size=cfg.tensor_parallel_size,
        seed=0,
        additional_config={"swiftkv": {"prefill_skipping": variant.prefill_skipping}},
    )
    cache = llm.llm_engine.vllm_config.cache_config
    variant.kv_tokens = cache.num_gpu_blocks * cache.block_size
    return llm


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
            engine.add_request(f"{tag}-{next_request}", prompt, sampling_params(output_len))
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


def measure(cfg: ServingBenchConfig, variants: list[Variant], input_lens: list[int]) -> None:
    max_model_len = max(input_lens + [cfg.latency_input_len]) + max(cfg.output_lens + [cfg.latency_output_len]) + 8
    engines = [start_engine(v, cfg, max_model_len) for v in variants]
    prompts = PromptMaker(cfg.vocab_limit, seed=0)
    cells = [(i, o) for i in input_lens for o in cfg.output_lens]
    # Warm-up, untimed: one pass at every input length, so that first-use costs of each batch shape
    # (kernel selection, compilation for new sizes) are part of no figure.
    for llm in engines:
        for input_len in input_lens:
            offline_throughput(llm, prompts.batch(-1 - input_len, cfg.num_prompts, input_len), 2)
    steps = tqdm(total=cfg.rounds * (len(cells) + 1) * len(variants), desc="bench_vllm", unit="run")
    for round_ in range(cfg.rounds):
        for key, (input_len, output_len) in enumerate(cells):
            batch = prompts.batch(round_ * 100 + key, cfg.num_prompts, input_len)
            for variant, llm in zip(variants, engines, strict=True):
                variant.throughput.setdefault(f"{input_len}x{output_len}", []).append(
                    offline_throughput(llm, batch, output_len)
                )
                steps.update()
        batch = prompts.batch(round_ * 100 + 99, cfg.latency_requests, cfg.latency_input_len)
        for variant, llm in zip(variants, engines, strict=True):
            ttft, tpot = fixed_rate_latency(llm, batch, cfg.latency_output_len, cfg.rate, f"lat{round_}")
            variant.ttft.append(statistics.median(ttft))
            variant.tpot.append(statistics.median(tpot))
            steps.update()
    steps.close()


def _paired_ratio(values: list[float], base: list[float]) -> float:
    """Median over rounds of (variant / base) within each round."""
    return statistics.median(v / b for v, b in zip(values, base, strict=True))


def summarize(variants: list[Variant], cfg: ServingBenchConfig) -> dict:
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
    return {"config": cfg.model_dump(), "variants": [v.name for v in variants], "throughput_tok_s": rows,
            "latency": latency, "kv_capacity": capacity, "raw": [asdict(v) | {"path": str(v.path)} for v in variants]}


def format_report(result: dict) -> str:
    names, cfg = result["variants"], result["config"]
    lines = ["Offline throughput, (input + output) tokens/s, median of rounds (median per-round ratio to base)",
             f"{'input x output':>15} | " + " | ".join(f"{n:>34}" for n in names)]
    for row in result["throughput_tok_s"]:
        cells = [f"{row[n]:>25.1f} ({row[f'{n} / base']:.2f}x)" for n in names]
        lines.append(f"{row['cell']:>15} | " + " | ".join(cells))
    lines.append(f"\nFixed rate {cfg['rate']}/s, {cfg['latency_input_len']} in / {cfg['latency_output_len']} out:")
    for n in names:
        lat = result["latency"][n]
        lines.append(f"  {n:>34}: TTFT {lat['ttft_median_s'] * 1e3:8.1f} ms ({lat['ttft_ratio']:.2f}x)   "
                     f"TPOT {lat['tpot_median_s'] * 1e3:7.1f} ms ({lat['tpot_ratio']:.2f}x)")
    lines.append("\nKV cache capacity in the same memory:")
    for n in names:
        cap = result["kv_capacity"][n]
        lines.append(f"  {n:>34}: {cap['kv_tokens']:>9} tokens ({cap['ratio']:.2f}x)")
    return "\n".join(lines)


def plot_png(result: dict) -> bytes:
    """Bars of every cell's throughput ratio to the base, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, names = result["throughput_tok_s"], result["variants"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([x + i * width for x in range(len(rows))], [r[f"{name} / base"] for r in rows], width, label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(rows))], [r["cell"] for r in rows])
    ax.set_xlabel("input tokens x output tokens")
    ax.set_ylabel("throughput / base")
    ax.set_title(f"vLLM throughput vs base: {Path(result['config']['model']).name}")
    ax.legend(fontsize=8)
    return figure_png(fig)


def run_benchmark(cfg: ServingBenchConfig) -> dict:
    """Prepare the checkpoints, measure them side by side and return the summary."""
    if not cfg.use_gpu:  # in-process CPU engines: a separate engine process would compete for the cores
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.cpu_kv_cache_gib))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    variants = prepare_models(cfg)
    input_lens = fit_input_lens(cfg, variants[0].path)
    measure(cfg, variants, input_lens)
    return summarize(variants, cfg)
