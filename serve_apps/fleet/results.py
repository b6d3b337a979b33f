"""The figures of one run: latency percentiles, SLO attainment, replica-hours, goodput per
replica-hour, scale events, and the replicas/TTFT timeline."""

from __future__ import annotations

import math
from typing import Any

from serve_apps.fleet.simulator import RunResult
from serve_apps.load import percentile


def _percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) if values else math.nan for q in (50, 90, 99)}


def summarize(run: RunResult, slo_ttft_s: float, score_from_s: float = 0.0) -> dict[str, Any]:
    """Every figure of ``run`` at a TTFT SLO of ``slo_ttft_s`` (a request never answered counts as
    missing it; its TTFT as infinite in the percentiles). Latency, attainment and goodput are over the
    requests arriving from ``score_from_s`` on; replica-hours, throughput and the cache share over the
    whole run. ``slo_attainment`` is over every scored request; ``feasible_slo_attainment`` over those
    whose prompt an idle replica prefills within the SLO (no fleet can answer the others in time: a
    126K-token prompt takes seconds on one GPU)."""
    scored = [(r, idle) for r, idle in zip(run.requests, run.idle_ttft_s, strict=True) if r.arrival_s >= score_from_s]
    requests = [r for r, _ in scored]
    ttfts = [math.inf if r.ttft_s is None else r.ttft_s for r in requests]
    done = [r for r in run.requests if r.finish_s is not None]
    within = sum(1 for t in ttfts if t <= slo_ttft_s)
    feasible = [t for t, (_, idle) in zip(ttfts, scored, strict=True) if idle <= slo_ttft_s]
    feasible_within = sum(1 for t in feasible if t <= slo_ttft_s)
    replica_s = sum(stop - start for start, stop in run.replicas)
    busy_s = sum(r.finish_s - r.routed_s for r in done)
    span = max(run.end_s, 1e-9)
    tpots = [(r.finish_s - r.first_token_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    prompt = sum(r.input_tokens for r in done)
    hours = span / 3600
    return {
        "requests": len(run.requests),
        "scored_requests": len(requests),
        "finished": len(done),
        "failed": len(run.requests) - len(done),
        "ttft_s": _percentiles(ttfts),
        "tpot_s": _percentiles(tpots),
        "slo_ttft_s": slo_ttft_s,
        "slo_attainment": within / len(requests) if requests else math.nan,
        "feasible_share": len(feasible) / len(requests) if requests else math.nan,
        "feasible_slo_attainment": feasible_within / len(feasible) if feasible else math.nan,
        "meets_p90_slo": bool(ttfts) and percentile(ttfts, 90) <= slo_ttft_s,
        "replica_hours": replica_s / 3600,
        "mean_replicas": replica_s / span,
        "mean_ongoing_per_replica": busy_s / replica_s if replica_s else math.nan,
        "peak_replicas": max([run.initial_replicas, *(row["replicas"] for row in run.timeline)]),
        "goodput_per_replica_hour": within / (replica_s / 3600) if replica_s else math.nan,
        "request_throughput": len(done) / span,
        "output_tokens_per_s": sum(r.output_tokens for r in done) / span,
        "uncached_prompt_share": sum(r.uncached_tokens for r in done) / prompt if prompt else math.nan,
        "preemptions": sum(r.preemptions for r in run.requests),
        "recomputed_prompt_share": sum(r.recomputed_tokens for r in done) / prompt if prompt else math.nan,
        "scale_events": len(run.scale_events),
        "scale_events_per_hour": len(run.scale_events) / hours if hours else math.nan,
        "duration_s": span,
        "stopped_early": run.stopped_early,
    }


def timeline(run: RunResult, period_s: float) -> list[dict[str, float]]:
    """The run's timeline with, per period, the arrivals and the TTFT p90 of the requests that
    arrived in it."""
    by_period: dict[int, list[float]] = {}
    for r in run.requests:
        by_period.setdefault(int(r.arrival_s // period_s), []).append(math.inf if r.ttft_s is None else r.ttft_s)
    rows = []
    for row in run.timeline:
        ttfts = by_period.get(int(row["t"] // period_s), [])
        rows.append({**row, "arrivals": len(ttfts), "ttft_p90_s": percentile(ttfts, 90) if ttfts else math.nan})
    return rows
