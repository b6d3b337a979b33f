"""The H100 profile, derived (not measured) from published figures for Llama-3.1-8B-Instruct on one
H100 80 GB under vLLM, our FLOPs model and the H100's data sheet.

Fitted, two parameters to four figures: the effective FLOP/s of the prompt's matrix products
(projections and MLP) and of its attention, so that this simulator's replica, replaying the paper's
throughput runs (Fig. 3: ~15M tokens of requests at once, 256 output tokens each), gives the base
model's combined tokens/s at 2K, 8K, 32K and 128K-token prompts (least squares on the log). The
prefill rate at length ``n`` is then ``1 / (matmul FLOPs(n) / F_matmul + attention FLOPs(n) / F_attn)``
for every variant: SwiftKV's and AcrossKV's rates come from their FLOPs (``swiftkv.analysis.flops``),
not from their figures.

Not fitted, and reported beside what the profile gives for them (:func:`checks`): Fig. 3's SwiftKV
and AcrossKV figures at the same four lengths, Fig. 2's forward-time saving at 50% SwiftKV, and
Table 3's throughput with vLLM's memory limited to 80, 40 and 20 GB.

Assumptions, not paper figures: decode steps read the bf16 weights and the batch's KV at 80% of the
H100's 3.35 TB/s (``hbm_efficiency``); vLLM's memory split is the one its maintainers published for
Llama-3-8B on an H100 80 GB (vLLM PR #10511, "overhaul memory profiling": 79.22 GiB total x 0.90 =
71.29 GiB usable, weights 14.96 GiB, non-torch 1.79 GiB, activation peak 1.26 GiB, 53.29 GiB of KV
cache), and Table 3's "memory" is the usable share (``gpu_memory_utilization`` x total), the rest
split the same way; 256 sequences. Start-up (a new replica's engine, from start to ready) takes
82 s: Llama-3.1-8B-Instruct under vLLM with its weights on a local volume and torch.compile's cache
warm (weight loading 18 s, Dynamo 10 s, compilation 13 s, CUDA graph capture 7 s, engine init and
imports 34 s; 294 s with nothing cached), measured on an L40S by Tensorfuse, "Reducing GPU Cold Start
Time when using vLLM" (tensorfuse.io/docs/blogs/reducing_gpu_cold_start): a published figure for the
same model and engine, not an H100 measurement (``fleet.startup_s`` overrides it).

Paper figures (SwiftKV, Qiao et al., arXiv:2410.03960), as read from its plots and tables; vLLM at
its ``max_num_batched_tokens`` of 2048 (the paper's setting).
"""

from __future__ import annotations

import math
from functools import cache

from serve_apps.fleet.config import FleetConfig
from serve_apps.fleet.profile import ModelFigures, Profile
from serve_apps.fleet.results import summarize
from serve_apps.fleet.simulator import simulate
from serve_apps.fleet.trace import Trace, TraceRequest

HARDWARE = "1 x NVIDIA H100 80GB SXM (derived from the SwiftKV paper's figures, not measured)"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 131072}
CUTOFF = 16  # 50% SwiftKV
GROUPS = {"base": None, "swiftkv-50": 1, "swiftkv-50-acrosskv": 4}  # AcrossKV: 4-way

# Fig. 3, Llama-3.1-8B on one H100: combined (input + output) tokens/s by prompt length, 256 output
# tokens; the middle of each range the figure spans.
FIG3 = {
    "base": {2000: 23_000.0, 8000: 22_000.0, 32000: 17_000.0, 128000: 8_000.0},
    "swiftkv-50": {2000: 28_500.0, 8000: 30_000.0, 32000: 27_000.0, 128000: 14_500.0},
    "swiftkv-50-acrosskv": {2000: 30_500.0, 8000: 32_500.0, 32000: 28_000.0, 128000: 15_500.0},
}
FIG2_TIME_SAVED = 0.425  # Fig. 2: a 50% SwiftKV forward pass takes 40-45% less time (128-2,048 tokens)
# Table 3: tokens/s with vLLM's memory limited to this many GB (its prompt length is not given:
# 8K taken, where Fig. 3's base matches its 80 GB row). Its 16 GB row is left out: the base does
# not fit there, in the paper as here.
TABLE3 = {80: {"base": 22_900.0, "swiftkv-50": 31_000.0}, 40: {"base": 20_600.0, "swiftkv-50": 27_300.0},
          20: {"base": 10_800.0, "swiftkv-50": 12_200.0, "swiftkv-50-acrosskv": 18_000.0}}
TABLE3_INPUT = 8000
PAPER_MAX_BATCHED_TOKENS = 2048
BENCH_OUTPUT, BENCH_TOKENS, BENCH_MAX_REQUESTS = 256, 15e6, 2048  # requests capped: the steady state is reached

HBM_PEAK_BYTES_PER_S = 3.35e12
HBM_EFFICIENCY = 0.8  # share of the peak a decode step's reads get (an assumption; --hbm-efficiency)
BF16_DENSE_PEAK_FLOPS = 989e12  # the H100 SXM data sheet: a fit above this is not physical
GIB = 2**30
USABLE_BYTES = 71.29 * GIB  # vLLM PR #10511's Llama-3-8B on an H100 80 GB (module docstring)
OVERHEAD_BYTES = (14.96 + 1.79 + 1.26) * GIB  # its weights, non-torch memory and activation peak
STARTUP_S = 82.0  # Tensorfuse's warm-cache cold start of this model under vLLM (module docstring)
LENGTHS = (512, 2048, 8192, 32768, 131072)
TOLERANCE = 0.15  # a check further off than this is flagged


@cache
def _config():
    from transformers import LlamaConfig

    return LlamaConfig(**LLAMA_8B)


@cache
def _flops(n: int, group: int | None) -> tuple[float, float]:
    """Matmul and attention FLOPs per prompt token (logits for the last token only)."""
    from swiftkv.analysis.flops import prefill_flops

    f = prefill_flops(_config(), n, None if group is None else CUTOFF, group or 1)
    return f.total - f.vocab - f.attention, f.attention


@cache
def _kv_bytes_per_token(group: int | None) -> int:
    from swiftkv.analysis.flops import kv_cache_bytes_per_token, swiftkv_kv_layers

    config = _config()
    return kv_cache_bytes_per_token(config, None if group is None else swiftkv_kv_layers(config, CUTOFF, group))


def _weight_bytes() -> int:
    from swiftkv.analysis.flops import base_param_count

    return base_param_count(_config()) * 2  # bf16


def kv_tokens(name: str, usable_bytes: float = USABLE_BYTES) -> int:
    """KV-cache tokens of one replica when vLLM may use ``usable_bytes`` of the GPU."""
    return max(0, int((usable_bytes - OVERHEAD_BYTES) // _kv_bytes_per_token(GROUPS[name])))


def _variant(name: str, matmul_flops_per_s: float, attention_flops_per_s: float,
             hbm_bytes_per_s: float) -> ModelFigures:
    group = GROUPS[name]
    rates = {}
    for n in LENGTHS:
        matmul, attention = _flops(n, group)
        rates[n] = 1 / (matmul / matmul_flops_per_s + attention / attention_flops_per_s)
    per_token = _kv_bytes_per_token(group)
    weights = _weight_bytes()
    step_s = {b: (weights + b * 1024 * per_token) / hbm_bytes_per_s for b in (1, 64, 256)}
    by_context = {n: (weights + 64 * n * per_token) / hbm_bytes_per_s for n in (1024, 8192, 32768)}
    return ModelFigures(
        model=MODEL if group is None else f"{MODEL} at 50% SwiftKV (c={CUTOFF}, g={group})",
        hardware=HARDWARE, prefill_tokens_per_s=rates[8192], prefill_tokens_per_s_by_input_len=rates,
        decode_step_s_by_batch=step_s, decode_context_tokens=1024, decode_step_s_by_context=by_context,
        decode_context_batch=64, kv_cache_tokens=kv_tokens(name),
        max_num_batched_tokens=PAPER_MAX_BATCHED_TOKENS, max_num_seqs=256, startup_s=STARTUP_S,
        notes="derived by serve_apps.fleet.paper_profile (see its docstring): prefill from the base's four "
              "Fig. 3 throughputs over our FLOPs model (matmul and attention rates fitted); decode, KV "
              "capacity and start-up from the H100 data sheet, vLLM's published memory split and stated "
              "assumptions",
    )


def bench_tokens_per_s(figures: ModelFigures, input_tokens: int) -> float:
    """The paper's throughput run on one simulated replica: ~15M tokens of requests of ``input_tokens``
    prompt and 256 output tokens, all at once; (input + output tokens) / seconds."""
    requests = min(BENCH_MAX_REQUESTS, round(BENCH_TOKENS / (input_tokens + BENCH_OUTPUT)))
    trace = Trace(tuple(TraceRequest(0.0, input_tokens, BENCH_OUTPUT) for _ in range(requests)), 512)
    cfg = FleetConfig(model="m", static_replicas=1, max_ongoing_requests=requests, tail_limit_s=1e7)
    figures = summarize(simulate(cfg, trace, Profile(models={"m": figures})), math.inf)
    if figures["failed"]:
        raise RuntimeError(f"the {input_tokens}-token throughput run left {figures['failed']} requests unanswered")
    return requests * (input_tokens + BENCH_OUTPUT) / figures["duration_s"]


def _fit(bandwidth: float) -> tuple[float, float]:
    """Matmul and attention FLOP/s whose base replica gives Fig. 3's four base figures (least squares
    on the log; Nelder-Mead from 500 / 400 TFLOP/s). Rates are bounded at ten times the dense bf16
    peak: a bandwidth too low for the figures sends the fit's matmul rate off to infinity otherwise,
    and the answer (not physical) is the same at the bound."""
    from scipy.optimize import minimize

    def loss(x) -> float:
        base = _variant("base", math.exp(x[0]) * 1e12, math.exp(x[1]) * 1e12, bandwidth)
        return sum(math.log(bench_tokens_per_s(base, n) / paper) ** 2 for n, paper in FIG3["base"].items())

    bounds = [(math.log(1.0), math.log(10 * BF16_DENSE_PEAK_FLOPS / 1e12))] * 2
    result = minimize(loss, [math.log(500), math.log(400)], method="Nelder-Mead", bounds=bounds,
                      options={"xatol": 0.002, "fatol": 1e-6})
    return math.exp(result.x[0]) * 1e12, math.exp(result.x[1]) * 1e12


def derive(hbm_efficiency: float = HBM_EFFICIENCY) -> Profile:
    """The profile: matmul and attention rates fitted to Fig. 3's base figures, decode steps reading at
    ``hbm_efficiency`` of the H100's peak bandwidth. A fitted rate above the H100's dense bf16 peak is
    said to be not physical in the profile's ``source``."""
    bandwidth = HBM_PEAK_BYTES_PER_S * hbm_efficiency
    matmul, attention = _fit(bandwidth)
    high = [f"{name} {rate / 1e12:.0f}" for name, rate in (("matmul", matmul), ("attention", attention))
            if rate > BF16_DENSE_PEAK_FLOPS]
    physical = f" ({', '.join(high)}: above the H100's dense bf16 peak of {BF16_DENSE_PEAK_FLOPS / 1e12:.0f}, " \
               "not physical)" if high else ""
    return Profile(
        source=f"derived, not measured: `swiftkv fleet derive-h100` (serve_apps/fleet/paper_profile.py); prefill at "
               f"{matmul / 1e12:.0f} TFLOP/s effective for the matmuls and {attention / 1e12:.0f} for attention"
               f"{physical}, fitted to the paper's base throughput at 2K, 8K, 32K and 128K tokens; decode at "
               f"{hbm_efficiency:.0%} of the HBM peak",
        models={name: _variant(name, matmul, attention, bandwidth) for name in GROUPS},
    )


def checks(profile: Profile) -> list[dict[str, object]]:
    """Every paper figure named in the module docstring beside what ``profile`` gives for it: whether
    the derivation was fitted to it, and the error (flagged past 15%)."""
    rows: list[dict[str, object]] = []

    def add(figure: str, variant: str, paper: float, simulated: float, fitted: bool = False,
            share: bool = False) -> None:
        error = simulated / paper - 1
        rows.append({"figure": figure, "variant": variant, "paper": paper, "simulated": simulated, "error": error,
                     "fitted": fitted, "flagged": not fitted and abs(error) > TOLERANCE, "share": share})

    for name, figures in FIG3.items():
        for n, paper in figures.items():
            add(f"Fig. 3, {name}, {n // 1000}K in / 256 out (tok/s)", name, paper,
                bench_tokens_per_s(profile.figures(name), n), fitted=name == "base")
    base, swift = (profile.figures(name).prefill_tokens_per_s_by_input_len[2048] for name in ("base", "swiftkv-50"))
    add("Fig. 2, 50% SwiftKV forward time saved at 2,048 tokens", "swiftkv-50", FIG2_TIME_SAVED, 1 - base / swift,
        share=True)
    for gb, figures in TABLE3.items():
        for name, paper in figures.items():
            # the full GPU is the profile's own split (vLLM's default 0.9 of 80 GB); a smaller limit keeps its overhead
            usable = USABLE_BYTES if gb == 80 else gb * GIB
            limited = profile.figures(name).model_copy(update={"kv_cache_tokens": kv_tokens(name, usable)})
            add(f"Table 3, {gb} GB, {name} (tok/s)", name, paper, bench_tokens_per_s(limited, TABLE3_INPUT))
    return rows


def caveats(rows: list[dict[str, object]]) -> dict[str, str]:
    """Per variant, the paper figures the profile misses by more than 15%, in a few words."""
    out: dict[str, list[str]] = {}
    for row in rows:
        if row["flagged"]:
            where = str(row["figure"]).split(" (")[0].replace(f", {row['variant']}", "").replace(" / 256 out", "")
            out.setdefault(str(row["variant"]), []).append(f"{where} {row['error']:+.0%}")
    return {variant: f"{variant}: " + ", ".join(misses) for variant, misses in out.items()}


def format_checks(rows: list[dict[str, object]]) -> str:
    """The checks as a markdown table (the figures fitted to marked, an error past 15% in bold)."""
    lines = ["| paper figure | paper | simulated | error |", "| --- | ---: | ---: | ---: |"]
    for row in rows:
        paper, simulated, error = row["paper"], row["simulated"], row["error"]
        show = (lambda v: f"{v:.1%}") if row["share"] else (lambda v: f"{v:,.0f}")
        mark = " (fitted)" if row["fitted"] else ""
        cell = f"**{error:+.0%} (over 15%)**" if row["flagged"] else f"{error:+.0%}"
        lines.append(f"| {row['figure']}{mark} | {show(paper)} | {show(simulated)} | {cell} |")
    return "\n".join(lines)
