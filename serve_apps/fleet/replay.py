"""A trace replayed against a real OpenAI-compatible endpoint at its arrival times, each request sent
and timed by vLLM's own benchmark request function (streamed ``/v1/completions``, TTFT measured at
the first streamed token).

Prompts are token ids built block by block from the trace's prefix block ids (a block's tokens are
drawn from a generator seeded by its id), so two requests that share leading block ids share those
tokens exactly and the engine's prefix cache sees the trace's reuse.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from typing import Any

from serve_apps.fleet.trace import Trace, TraceRequest

BURST_BLOCK_TOKENS = 16  # prompt blocks of a Burst's requests (each request's first one is new)
FIRST_TOKEN_ID = 10  # below this, special tokens in most vocabularies
PROMPT_VOCAB = 32000  # prompt ids drawn below this: every model served here has a larger vocabulary
WARMUP_SALT = 7919  # a warm-up's ids: the trace's shifted by this (see `salted`)
PASS_SALT = 104729  # pass k of a replay repeated: the trace's shifted by k times this


def prompt_ids(request: TraceRequest, index: int, block_tokens: int, vocab: int) -> list[int]:
    """The request's prompt: one run of ``block_tokens`` ids per prefix block id, then (for a prompt
    longer than its blocks) ids unique to the request; cut to its length."""
    ids: list[int] = []
    for block in request.blocks:
        rng = random.Random(block)
        ids += [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(block_tokens)]
    if len(ids) < request.input_tokens:
        rng = random.Random(f"request-{index}")
        ids += [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(request.input_tokens - len(ids))]
    return ids[: request.input_tokens]


def salted(prompt: list[int], salt: int, vocab: int) -> list[int]:
    """``prompt`` with every id shifted by ``salt`` (within ``FIRST_TOKEN_ID..vocab``): prompts that
    shared a prefix still share it, and none shares a block with the unsalted ones (salt 0: as is)."""
    return [(t - FIRST_TOKEN_ID + salt) % (vocab - FIRST_TOKEN_ID) + FIRST_TOKEN_ID for t in prompt]


async def _send_all(base_url: str, model: str, trace: Trace, vocab: int, timeout_s: float,
                    salt: int) -> list[dict[str, Any]]:
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_completions

    prompts = [salted(prompt_ids(r, i, trace.block_tokens, vocab), salt, vocab) for i, r in enumerate(trace.requests)]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        start = time.perf_counter()
        tasks = []
        for request, prompt in zip(trace.requests, prompts, strict=True):
            delay = start + request.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            job = RequestFuncInput(prompt=prompt, api_url=f"{base_url}/v1/completions", prompt_len=len(prompt),
                                   output_len=request.output_tokens, model=model, ignore_eos=True)
            tasks.append(asyncio.create_task(async_request_openai_completions(job, session)))
        outputs = await asyncio.gather(*tasks)
    return [{"sent_s": out.start_time - start, "ttft_s": out.ttft if out.success else None,
             "latency_s": out.latency if out.success else None, "output_tokens": out.output_tokens,
             "error": out.error[:200] if not out.success else ""} for out in outputs]


def replay(base_url: str, model: str, trace: Trace, vocab: int, timeout_s: float = 600.0,
           salt: int = 0) -> list[dict[str, Any]]:
    """Send ``trace`` to ``base_url`` (``http://host:port``); one record per request, in trace order.
    ``salt``: the same lengths and timing with every token id shifted (:func:`salted`), so nothing an
    earlier pass with another salt left in the prefix cache is found (a warm-up, a repeated pass)."""
    return asyncio.run(_send_all(base_url, model, trace, vocab, timeout_s, salt))


class Burst:
    """Sends batches of fresh prompts (a new first block each: nothing cached) through the endpoint at
    once; the calibrations through Serve are made of these."""

    def __init__(self, url: str, model: str, timeout_s: float) -> None:
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self.blocks = itertools.count(10**12)  # beyond any trace's block ids

    def send(self, requests: int, input_tokens: int, output_tokens: int) -> list[dict[str, Any]]:
        """Send ``requests`` prompts together; their records (as :func:`replay`'s), all answered in full."""
        blocks = -(-input_tokens // BURST_BLOCK_TOKENS)
        trace = Trace(tuple(TraceRequest(0.0, input_tokens, output_tokens,
                                         tuple(next(self.blocks) for _ in range(blocks)))
                            for _ in range(requests)), BURST_BLOCK_TOKENS)
        records = replay(self.url, self.model, trace, PROMPT_VOCAB, self.timeout_s)
        failed = [r["error"] for r in records if r["latency_s"] is None]
        if failed:
            raise RuntimeError(f"{len(failed)} of {requests} calibration requests failed: {failed[0]}")
        short = [r for r in records if r["output_tokens"] != output_tokens]
        if short:
            raise RuntimeError(f"{len(short)} requests returned {short[0]['output_tokens']} tokens, not "
                               f"{output_tokens} (ignore_eos must hold)")
        return records

    def seconds(self, requests: int, input_tokens: int, output_tokens: int) -> float:
        """Wall seconds from sending ``requests`` prompts together to the last one's end."""
        records = self.send(requests, input_tokens, output_tokens)
        return max(r["sent_s"] + r["latency_s"] for r in records) - min(r["sent_s"] for r in records)
