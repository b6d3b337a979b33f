"""Traffic for the load test, sent with vLLM's own benchmark client (``vllm.benchmarks.serve``).

vLLM's ``benchmark()`` coroutine is what ``vllm bench serve`` runs: it paces requests (Poisson at a
rate, or all at once), caps concurrency, streams each completion and measures TTFT, TPOT and ITL
per request. Here it gets request lists built by this module (random token-id prompts of exact
lengths, never repeated, so neither the prefix cache nor the router's prefix memory can help) and
its per-request figures are summarised per prompt class.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import random
import statistics
from dataclasses import dataclass
from typing import Any

from serve_apps.load import percentile

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Request:
    """One request of a run: token ids and how many tokens to generate."""

    prompt: list[int]
    output_len: int


def random_prompts(count: int, length: int, seed: int, vocab: int = 32000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


def uniform(count: int, input_len: int, output_len: int, seed: int) -> list[Request]:
    return [Request(p, output_len) for p in random_prompts(count, input_len, seed)]


def long_short_mix(count: int, long_share: float, long_len: int, long_output_len: int, short_len: int,
                   short_output_len: int, seed: int) -> list[Request]:
    """``count`` requests, ``long_share`` of them long, in a seeded random order."""
    longs = max(1, round(count * long_share))
    requests = (uniform(longs, long_len, long_output_len, seed) +
                uniform(count - longs, short_len, short_output_len, seed + 7919))
    random.Random(seed).shuffle(requests)
    return requests


def send(base_url: str, model: str, tokenizer, requests: list[Request], rate: float = float("inf"),
         concurrency: int | None = None, seed: int = 0, quiet: bool = True) -> dict[str, Any]:
    """Run ``requests`` against ``base_url``'s ``/v1/completions`` with vLLM's benchmark client
    (Poisson arrivals at ``rate``, drawn from ``seed``, or all at once); return its result
    (aggregates plus per-request ``input_lens``, ``ttfts``, ``itls``, ``errors``)."""
    import numpy as np
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.serve import TaskType, benchmark

    np.random.seed(seed)  # vLLM's client draws the arrival gaps from numpy's global generator

    samples = [SampleRequest(prompt=r.prompt, prompt_len=len(r.prompt), expected_output_len=r.output_len)
               for r in requests]
    run = benchmark(
        task_type=TaskType.GENERATION, endpoint_type="openai", api_url=f"{base_url}/v1/completions",
        base_url=base_url, model_id=model, model_name=model, tokenizer=tokenizer, input_requests=samples,
        logprobs=None, request_rate=rate, burstiness=1.0, disable_tqdm=quiet, num_warmups=0, profile=False,
        selected_percentile_metrics=["ttft", "tpot", "itl", "e2el"], selected_percentiles=list(PERCENTILES),
        ignore_eos=True, goodput_config_dict={}, max_concurrency=concurrency, lora_modules=None,
        extra_headers=None, extra_body=None, ready_check_timeout_sec=0,
    )
    if quiet:  # vLLM prints its own result table; the report below has the same figures
        with contextlib.redirect_stdout(io.StringIO()):
            return asyncio.run(run)
    return asyncio.run(run)


def percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{p}": percentile(values, p) if values else float("nan") for p in PERCENTILES}


def summarize(result: dict[str, Any], min_input_len: int = 0, max_input_len: int | None = None) -> dict[str, Any]:
    """Throughput and latency percentiles (seconds) of the successful requests whose prompt length is
    within ``[min_input_len, max_input_len]``; failed requests are counted, never dropped silently."""
    rows = [
        (ttft, itl, error)
        for n, ttft, itl, error in zip(result["input_lens"], result["ttfts"], result["itls"], result["errors"],
                                       strict=True)
        if n >= min_input_len and (max_input_len is None or n <= max_input_len)
    ]
    ok = [(ttft, itl) for ttft, itl, error in rows if not error]
    tpots = [statistics.fmean(itl) for _, itl in ok if itl]
    return {
        "requests": len(rows),
        "failed": len(rows) - len(ok),
        "errors": sorted({error[:200] for _, _, error in rows if error})[:5],
        "request_throughput": result["request_throughput"],
        "total_token_throughput": result["total_token_throughput"],
        "duration_s": result["duration"],
        "ttft_s": percentiles([ttft for ttft, _ in ok]),
        "tpot_s": percentiles(tpots),
    }
