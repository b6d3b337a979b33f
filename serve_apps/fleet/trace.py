"""Request traces (arrival, prompt and output lengths, prefix block ids) and the transformations a
fleet study needs. :mod:`serve_apps.fleet.trace_files` reads them from files.

Prefix blocks are ``block_tokens`` tokens each (512 in the Mooncake traces): equal ids at the start of
two requests mean a shared prefix; the last block may be partial. A trace without prefix ids (Azure's)
has none.

Scaling keeps the trace's structure: :func:`superpose` adds copies of the trace as independent user
populations (disjoint block ids, each copy shifted in time) to raise the arrival rate without
compressing conversations; :func:`scale_lengths` shrinks prompts block by block (so prefixes stay
shared) for hardware that cannot run the real lengths.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, replace

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per prefix block in the Mooncake traces."""


@dataclass(frozen=True)
class TraceRequest:
    """One request: when it arrives, how long it is, which prefix blocks it starts with."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Trace:
    """Requests in arrival order, and the size of their prefix blocks."""

    requests: tuple[TraceRequest, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0


def window(trace: Trace, start_s: float = 0.0, duration_s: float | None = None, limit: int | None = None) -> Trace:
    """The requests arriving in ``[start_s, start_s + duration_s)`` (at most ``limit``), re-timed from 0."""
    end = math.inf if duration_s is None else start_s + duration_s
    chosen = [replace(r, arrival_s=r.arrival_s - start_s) for r in trace.requests if start_s <= r.arrival_s < end]
    if limit is not None:
        chosen = chosen[:limit]
    if not chosen:
        raise ValueError(f"no requests between {start_s:g} s and {end:g} s of the trace")
    return Trace(tuple(chosen), trace.block_tokens)


def shuffle_simultaneous(trace: Trace, within_s: float, seed: int) -> Trace:
    """The trace with each group of requests arriving within ``within_s`` of the group's first put in
    a random (seeded) order, the arrival times kept: requests sent together reach a real endpoint's
    router in the order its front end accepts them, not the trace's."""
    rng = random.Random(seed)
    reqs, out, start = trace.requests, [], 0
    while start < len(reqs):
        end = start + 1
        while end < len(reqs) and reqs[end].arrival_s - reqs[start].arrival_s <= within_s:
            end += 1
        group = list(reqs[start:end])
        rng.shuffle(group)
        out += [replace(r, arrival_s=t.arrival_s) for r, t in zip(group, reqs[start:end], strict=True)]
        start = end
    return Trace(tuple(out), trace.block_tokens)


def superpose(trace: Trace, copies: int) -> Trace:
    """``copies`` independent copies of the trace at once: ``copies`` times the arrival rate with the
    same shape. Copy ``j`` gets its own block ids (no prefix is shared across copies) and is shifted
    by ``j / copies`` of the trace's length, wrapping around, so the copies' bursts do not line up."""
    if copies < 1:
        raise ValueError(f"copies must be at least 1, got {copies}")
    span = trace.duration_s or 1.0
    id_stride = 1 + max((b for r in trace.requests for b in r.blocks), default=0)
    out = []
    for j in range(copies):
        shift = span * j / copies
        for r in trace.requests:
            out.append(replace(r, arrival_s=(r.arrival_s + shift) % span if j else r.arrival_s,
                               blocks=tuple(b + j * id_stride for b in r.blocks)))
    return Trace(tuple(sorted(out, key=lambda r: r.arrival_s)), trace.block_tokens)


def stretch(trace: Trace, factor: float) -> Trace:
    """Arrival times multiplied by ``factor`` (above 1: a slower replay)."""
    if factor <= 0:
        raise ValueError(f"the time factor must be positive, got {factor}")
    return Trace(tuple(replace(r, arrival_s=r.arrival_s * factor) for r in trace.requests), trace.block_tokens)


def scale_lengths(trace: Trace, block_tokens: int, max_input_tokens: int, max_output_tokens: int) -> Trace:
    """Prompts shrunk by ``block_tokens / trace.block_tokens`` block by block (prefix sharing kept),
    cut at ``max_input_tokens`` (whole blocks dropped from the end); outputs capped."""
    factor = block_tokens / trace.block_tokens
    max_blocks = max(1, max_input_tokens // block_tokens)
    out = []
    for r in trace.requests:
        tokens = max(1, min(round(r.input_tokens * factor), max_blocks * block_tokens, max_input_tokens))
        blocks = r.blocks[: math.ceil(tokens / block_tokens)]
        out.append(replace(r, input_tokens=tokens, output_tokens=max(1, min(r.output_tokens, max_output_tokens)),
                           blocks=blocks))
    return Trace(tuple(out), block_tokens)


def describe(trace: Trace) -> dict[str, float]:
    """What a trace holds for a router and a prefix cache: prompt lengths (mean, median, max, and the
    token-weighted mean a replica's work sees), output mean, blocks per request, the share of prompt
    tokens that repeat an earlier request's leading blocks, and the median seconds since a reused
    prefix (more than one block) was last sent."""
    inputs = [r.input_tokens for r in trace.requests]
    last_sent: dict[int, float] = {}
    repeated, gaps = 0, []
    for r in trace.requests:
        reused = next((i for i, block in enumerate(r.blocks) if block not in last_sent), len(r.blocks))
        repeated += min(reused * trace.block_tokens, r.input_tokens)
        if reused > 1:
            gaps.append(r.arrival_s - last_sent[r.blocks[reused - 1]])
        last_sent.update(dict.fromkeys(r.blocks, r.arrival_s))
    return {
        "requests": len(inputs), "input_mean": statistics.mean(inputs), "input_median": statistics.median(inputs),
        "input_max": max(inputs), "input_token_weighted_mean": sum(n * n for n in inputs) / sum(inputs),
        "output_mean": statistics.mean(r.output_tokens for r in trace.requests),
        "blocks_per_request": statistics.mean(len(r.blocks) for r in trace.requests),
        "repeated_prompt_token_share": repeated / sum(inputs),
        "reuse_gap_median_s": statistics.median(gaps) if gaps else float("nan"),
    }
