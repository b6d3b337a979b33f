"""Synthetic traces for sweeps: Poisson arrivals (a rate that may change over time), log-normal
prompt and output lengths, and multi-turn conversations whose later turns repeat the earlier turns'
prefix blocks (what a prefix cache and a prefix-aware router can use)."""

from __future__ import annotations

import math
import random

from pydantic import Field, model_validator

from serve_apps.fleet.trace import MOONCAKE_BLOCK_TOKENS, Trace, TraceRequest
from swiftkv.yaml_config import StrictConfig


class SyntheticConfig(StrictConfig):
    """A synthetic workload."""

    duration_s: float = Field(default=600.0, gt=0)
    """Seconds of traffic."""

    rate: float = Field(default=2.0, gt=0)
    """Mean arrivals per second (Poisson)."""

    rate_schedule: list[tuple[float, float]] = []
    """``[[time_s, rate], ...]``: from each ``time_s`` on, arrivals per second are ``rate`` (before the
    first entry, ``rate``): a burst or a daily ramp for autoscaling studies."""

    input_tokens_mean: float = Field(default=2000.0, gt=0)
    """Mean prompt length of a conversation's first turn (log-normal)."""

    input_tokens_sigma: float = Field(default=0.8, ge=0)
    """Log-normal shape of prompt lengths (0: all equal)."""

    output_tokens_mean: float = Field(default=256.0, gt=0)
    """Mean output length (log-normal)."""

    output_tokens_sigma: float = Field(default=0.5, ge=0)
    """Log-normal shape of output lengths."""

    max_tokens: int = Field(default=32768, gt=0)
    """Prompts and outputs are cut at this length."""

    followup_share: float = Field(default=0.5, ge=0, lt=1)
    """Share of requests that continue an open conversation (their prompt is that conversation's last
    prompt, its answer and a new message)."""

    followup_tokens_mean: float = Field(default=200.0, gt=0)
    """Mean length of the new message of a follow-up turn (exponential)."""

    open_conversations: int = Field(default=200, gt=0)
    """Conversations a follow-up may continue (the most recent ones)."""

    block_tokens: int = Field(default=MOONCAKE_BLOCK_TOKENS, gt=0)
    """Tokens per prefix block."""

    seed: int = 0
    """Random seed: the same config gives the same trace."""

    @model_validator(mode="after")
    def _schedule(self) -> SyntheticConfig:
        times = [t for t, _ in self.rate_schedule]
        if times != sorted(times) or any(rate < 0 for _, rate in self.rate_schedule):
            raise ValueError("rate_schedule: times must increase and rates must be non-negative")
        return self


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    # The log-normal with this mean: mu = ln(mean) - sigma^2 / 2.
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma) if sigma else mean


def _rate_at(cfg: SyntheticConfig, t: float) -> float:
    rate = cfg.rate
    for start, value in cfg.rate_schedule:
        if t >= start:
            rate = value
    return rate


def _arrivals(cfg: SyntheticConfig, rng: random.Random) -> list[float]:
    """A Poisson process whose rate follows the schedule (thinning of the highest rate)."""
    peak = max([cfg.rate, *(r for _, r in cfg.rate_schedule)])
    times, t = [], 0.0  # peak >= rate > 0 (validated)
    while True:
        t += rng.expovariate(peak)
        if t >= cfg.duration_s:
            return times
        if rng.random() * peak < _rate_at(cfg, t):
            times.append(t)


def generate(cfg: SyntheticConfig) -> Trace:
    """The trace ``cfg`` describes."""
    rng = random.Random(cfg.seed)
    bt = cfg.block_tokens
    next_block = 0
    conversations: list[tuple[int, tuple[int, ...]]] = []  # (context tokens so far, their blocks)
    requests = []
    for t in _arrivals(cfg, rng):
        output = max(1, min(cfg.max_tokens, round(_lognormal(rng, cfg.output_tokens_mean, cfg.output_tokens_sigma))))
        if conversations and rng.random() < cfg.followup_share:
            index = rng.randrange(len(conversations))
            context, blocks = conversations.pop(index)
            tokens = context + max(1, round(rng.expovariate(1 / cfg.followup_tokens_mean)))
        else:
            tokens, blocks = max(1, round(_lognormal(rng, cfg.input_tokens_mean, cfg.input_tokens_sigma))), ()
        tokens = min(tokens, cfg.max_tokens)
        # Keep the conversation's full blocks; the rest of the prompt is new.
        kept = blocks[: tokens // bt]
        fresh = math.ceil(tokens / bt) - len(kept)
        blocks = kept + tuple(range(next_block, next_block + fresh))
        next_block += fresh
        requests.append(TraceRequest(t, tokens, output, blocks))
        # The next turn repeats this prompt (its full blocks are shareable) and this answer.
        conversations.append((min(tokens + output, cfg.max_tokens), blocks[: tokens // bt]))
        del conversations[: -cfg.open_conversations]
    if not requests:
        raise ValueError("the synthetic config produced no requests (raise rate or duration_s)")
    return Trace(tuple(requests), bt)
