"""A replica's view of its own prefill load, as plain numbers.

One :class:`ReplicaLoad` is what every replica publishes, both to Serve's autoscaler
(``record_autoscaling_stats``) and to the request router (``record_routing_stats``); the policy and
the router are functions of these figures alone, so the fleet simulator can drive the very same
code. :class:`LoadTracker` turns the engine's per-step statistics (fed by
``serve_apps/engine_stats.py``, the only code here that knows vLLM's stat classes) into them.

Nothing in this module imports vLLM or Ray: it is pickled to Serve's controller and routers.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ReplicaLoad:
    """The load figures a replica publishes (every field a float, as Serve's metrics require)."""

    prompt_tokens_waiting: float = 0.0
    """Prompt tokens of requests still waiting for or in prefill (vLLM's own queued-token count:
    a request's whole prompt until its first token, prefix-cache hits included)."""

    prompt_tokens_per_s: float = 0.0
    """Prompt tokens arriving per second over the window (served + growth of the backlog)."""

    uncached_prompt_tokens_per_s: float = 0.0
    """Prompt tokens actually computed per second (not served from the prefix cache)."""

    uncached_fraction: float = 1.0
    """Share of prefilled prompt tokens that missed the prefix cache over the window (1 if none)."""

    running_requests: float = 0.0
    """Sequences the scheduler is running."""

    waiting_requests: float = 0.0
    """Requests the scheduler has not started."""

    kv_cache_usage: float = 0.0
    """Fraction of KV-cache blocks in use (0..1)."""

    preemptions_per_s: float = 0.0
    """Running requests the scheduler preempted per second over the window (vLLM's own count):
    the KV cache is full now, whatever its usage reads once the preempted requests' blocks are freed."""

    requests_finished_per_s: float = 0.0
    """Requests this replica completed per second over the window: its throughput in requests, the
    rate at which a fleet of such replicas drains the requests queued at the handles."""

    ttft_p90_s: float = 0.0
    """90th percentile time to first token of requests that got one in the window (0 if none)."""

    prefill_capacity: float = 0.0
    """This replica's prefill rate in uncached prompt tokens/s, as calibrated (``swiftkv calibrate``)."""

    timestamp: float = 0.0
    """When the figures were taken (``time.time()``)."""

    def to_metrics(self) -> dict[str, float]:
        return {name: float(getattr(self, name)) for name in _FIELD_NAMES}

    @classmethod
    def from_metrics(cls, metrics: dict[str, float] | None) -> ReplicaLoad:
        """Read the published dict back (unknown keys ignored, missing ones default)."""
        return cls(**{k: float(v) for k, v in (metrics or {}).items() if k in _FIELD_NAMES})

    @property
    def uncached_tokens_waiting(self) -> float:
        """Expected prefill work of the backlog: waiting tokens that will miss the prefix cache."""
        return self.prompt_tokens_waiting * self.uncached_fraction


_FIELD_NAMES = tuple(f.name for f in fields(ReplicaLoad))  # read per replica per routed request


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class LoadTracker:
    """Accumulates the engine's step statistics and answers :meth:`snapshot` over a sliding window.

    Rates are differences of cumulative counters between now and the oldest snapshot in the window,
    so they need no timer of their own: Serve asks for figures several times a second.
    """

    def __init__(self, prefill_capacity: float, window_s: float = 5.0) -> None:
        self.prefill_capacity = prefill_capacity
        self.window_s = window_s
        self.prefilled_tokens = 0  # cumulative prompt tokens whose prefill finished
        self.computed_tokens = 0  # ... of which were computed, not prefix-cache hits
        self.preempted = 0  # cumulative running requests preempted
        self.finished = 0  # cumulative requests completed
        self.last_step_monotonic: float | None = None  # when the engine last reported a step
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self._ttfts: deque[tuple[float, float]] = deque()
        # (t, prefilled, computed, waiting, preempted, finished)
        self._samples: deque[tuple[float, int, int, float, int, int]] = deque()

    def on_prefill_done(self, prompt_tokens: int, computed_tokens: int) -> None:
        self.prefilled_tokens += prompt_tokens
        self.computed_tokens += computed_tokens

    def on_first_tokens(self, now: float, ttfts: list[float]) -> None:
        self._ttfts.extend((now, t) for t in ttfts)

    def on_step(self, now_monotonic: float) -> None:
        """The engine finished a step (the replica's health check reads it: progress is liveness)."""
        self.last_step_monotonic = now_monotonic

    def on_preempted(self, requests: int) -> None:
        self.preempted += requests

    def on_finished(self, requests: int) -> None:
        self.finished += requests

    def on_scheduler(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        self.running, self.waiting, self.kv_cache_usage = running, waiting, kv_cache_usage

    def snapshot(self, now: float, prompt_tokens_waiting: float) -> ReplicaLoad:
        """The figures at ``now`` given the engine's current waiting prompt tokens."""
        self._samples.append((now, self.prefilled_tokens, self.computed_tokens, prompt_tokens_waiting,
                              self.preempted, self.finished))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()
        while self._ttfts and self._ttfts[0][0] < now - self.window_s:
            self._ttfts.popleft()
        t0, prefilled0, computed0, waiting0, preempted0, finished0 = self._samples[0]
        span = now - t0
        prefilled = self.prefilled_tokens - prefilled0
        computed = self.computed_tokens - computed0
        arrived = prefilled + (prompt_tokens_waiting - waiting0)
        return ReplicaLoad(
            prompt_tokens_waiting=prompt_tokens_waiting,
            prompt_tokens_per_s=max(0.0, arrived) / span if span > 0 else 0.0,
            uncached_prompt_tokens_per_s=computed / span if span > 0 else 0.0,
            uncached_fraction=computed / prefilled if prefilled > 0 else 1.0,
            running_requests=float(self.running),
            waiting_requests=float(self.waiting),
            kv_cache_usage=self.kv_cache_usage,
            preemptions_per_s=(self.preempted - preempted0) / span if span > 0 else 0.0,
            requests_finished_per_s=(self.finished - finished0) / span if span > 0 else 0.0,
            ttft_p90_s=percentile([t for _, t in self._ttfts], 90) if self._ttfts else 0.0,
            prefill_capacity=self.prefill_capacity,
            timestamp=now,
        )
