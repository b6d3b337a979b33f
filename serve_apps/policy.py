"""Autoscaling on prefill load: replicas enough for the prompt-token arrival rate and for the
backlog within a TTFT budget, with a KV-cache guard, and scale-down only when fewer replicas would
still meet the budget with room to spare.

Ray Serve's default policy counts ongoing requests, which is the wrong unit for LLM traffic (a
30-token and a 30,000-token prompt weigh the same). Here the unit is uncached prompt tokens, and a
replica's capacity is its calibrated prefill rate ``mu`` (tokens/s, ``swiftkv calibrate``). With
``lam`` the fleet's uncached prompt-token arrival rate and ``B`` the uncached tokens waiting, N
replicas keep up when ``lam <= u N mu`` (``u``: target utilisation) and clear the backlog within the
budget ``T`` when ``lam + B / T <= N mu``. The scale-down test uses a lower utilisation ``u_down``,
so a fleet just scaled down sits well below the scale-up line (no 2-1-2 flapping); Serve's own
``upscale_delay_s``/``downscale_delay_s`` and min/max bounds apply on top.

Serve's request counts weigh too: a decode-bound fleet fills its replicas' seats
(``max_ongoing_requests``) while its prompt tokens and KV cache look fine, and once every seat is
taken new requests queue at the handles for as long as a reply takes. So the requests at the
replicas ask for replicas enough to keep them within ``target_utilization`` of the seats, and a
scale-down must leave them within ``downscale_utilization`` (the same hysteresis as for tokens;
scaling down to exactly full seats made a decode-bound fleet queue, scale up, pay the start-up and
scale down again). The requests queued at the handles are work, not requests to seat at once:
with ``r`` the requests a replica completes per second, ``Q`` the queue and ``g`` its growth per
second, the fleet must complete what arrives (what it completes now, plus ``g``) and drain ``Q``
within the horizon ``H = max(T, S)`` (a queue cannot drain before the replicas started for it
serve), at ``target_utilization`` of its completion rate, and at most the replicas that would seat
every request at once (more would idle; and while the first long replies still run, completions
read the rate low). Seating the queue alone made a cold start under a full-rate trace ask for
``max_replicas``: thousands of requests queued during the start-up, which about as many replicas as
the arrival rate needs clear within a start-up time.

No request at all over the look-back window asks for zero replicas, which Serve bounds by
``min_replicas`` (Serve's own cold start brings the first replica back when a request arrives).

A replica asked for now serves only after its start-up time ``S`` (``replica_startup_s``): the
backlog that the running replicas clear before then, ``(N mu - lam) S``, is no reason to start one
(after a cold start the first replicas to come up find the queue of the whole start-up, clear it
in seconds, and replicas started for it would arrive a minute and a half later to no backlog).

The KV cache guard reads vLLM's preemptions as well as the mean usage: on long replies one replica
fills and preempts (recomputing the preempted request's prompt later) while the mean still reads
well under ``kv_cache_high``, and a preempted request's freed blocks make the usage read lower still.

:func:`decide` is a pure function of the replicas' :class:`~serve_apps.load.ReplicaLoad` figures,
so the fleet simulator calls the very same code; :class:`PrefillAutoscalingPolicy` is the adapter
Serve builds on its controller (``autoscaling_config.policy.policy_function``), with
``policy_kwargs`` validated as :class:`PrefillPolicyConfig`.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_apps.load import ReplicaLoad

log = logging.getLogger("ray.serve")


class PrefillPolicyConfig(BaseModel):
    """The prefill-aware policy's settings (``policy_kwargs``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    prefill_tokens_per_s: float = Field(gt=0)
    """One replica's prefill rate in uncached prompt tokens/s (measure it with ``swiftkv calibrate``
    on the replica's hardware, SwiftKV on)."""

    ttft_budget_s: float = Field(default=2.0, gt=0)
    """The backlog must clear within this many seconds (the queueing part of TTFT)."""

    target_utilization: float = Field(default=0.8, gt=0, le=1)
    """Scale up when the arrival rate exceeds this share of the fleet's prefill capacity."""

    downscale_utilization: float = Field(default=0.5, gt=0, le=1)
    """Scale down only to a count that would run below this share (must be below
    ``target_utilization``: the gap is the hysteresis band)."""

    kv_cache_high: float = Field(default=0.9, gt=0, le=1)
    """Add a replica when the replicas' mean KV-cache usage reaches this or any replica preempted a
    request over the window (decode memory pressure); never scale down meanwhile."""

    kv_cache_low: float = Field(default=0.6, gt=0, le=1)
    """Scale down only if the remaining replicas' projected KV-cache usage stays at or below this."""

    max_ongoing_requests: int = Field(default=64, gt=0)
    """Requests one replica takes at once (the deployment's own setting): its seats, filled to
    ``target_utilization`` at most before scaling up."""

    replica_startup_s: float = Field(default=0.0, ge=0)
    """Seconds from asking for a replica to its serving (``swiftkv fleet validate`` measures it): the
    backlog the running replicas clear within it asks for no new replica. 0: every backlog
    over the budget asks for replicas, as if they served at once."""

    @model_validator(mode="after")
    def _bands(self) -> PrefillPolicyConfig:
        if self.downscale_utilization >= self.target_utilization:
            raise ValueError("downscale_utilization must be below target_utilization (the hysteresis band)")
        if self.kv_cache_low >= self.kv_cache_high:
            raise ValueError("kv_cache_low must be below kv_cache_high")
        return self


@dataclass(frozen=True)
class Decision:
    """A replica count and why."""

    replicas: int
    reason: str
    demand_tokens_per_s: float = 0.0
    backlog_tokens: float = 0.0
    kv_cache_usage: float = 0.0


def _replicas_for(load_tokens_per_s: float, per_replica: float) -> int:
    return max(1, math.ceil(load_tokens_per_s / per_replica - 1e-9))


def _seats_for(requests: float | None, per_replica: float) -> int:
    """Replicas that hold ``requests`` at ``per_replica`` each (0 when Serve gave no count)."""
    return math.ceil((requests or 0.0) / per_replica - 1e-9)


def decide(loads: list[ReplicaLoad], current: int, cfg: PrefillPolicyConfig, requests: float | None = None,
           queued: float = 0.0, queue_growth_per_s: float = 0.0) -> Decision:
    """The replica count for ``current`` running replicas whose published figures are ``loads``
    (replicas that have not published yet are simply absent), given Serve's count of ``requests``
    (ongoing and queued; None: unknown), of those ``queued`` at the handles, and how fast that
    queue grows."""
    if current == 0 or not loads:
        return Decision(current, "no load figures yet: holding")
    decision = _by_load(loads, current, cfg, requests, queued, queue_growth_per_s)
    # Zero only when the figures would keep one replica at most: a window of short requests that
    # Serve's samples happen to miss must not undo a scale-up.
    if requests == 0 and decision.replicas <= 1:
        return Decision(0, "idle: no requests", decision.demand_tokens_per_s, decision.backlog_tokens,
                        decision.kv_cache_usage)
    return decision


def _to_drain_queue(loads: list[ReplicaLoad], cfg: PrefillPolicyConfig, current: int, queued: float,
                    growth_per_s: float) -> int:
    """Replicas that complete the requests arriving and drain the handles' queue within the horizon
    (one more than now while no replica has completed a request to rate it by)."""
    rated = [load.requests_finished_per_s for load in loads if load.requests_finished_per_s > 0]
    if not rated:
        return current + 1
    # A replica that started a moment ago has completed nothing yet: it is no measure of the rate.
    per_replica = sum(rated) / len(rated)
    arriving = max(0.0, sum(rated) + growth_per_s)  # completed now, plus what the queue gains
    horizon = max(cfg.ttft_budget_s, cfg.replica_startup_s)
    return _replicas_for(arriving + queued / horizon, cfg.target_utilization * per_replica)


def _by_load(loads: list[ReplicaLoad], current: int, cfg: PrefillPolicyConfig, requests: float | None,
             queued: float, queue_growth_per_s: float) -> Decision:
    mu, budget = cfg.prefill_tokens_per_s, cfg.ttft_budget_s
    demand = sum(load.prompt_tokens_per_s * load.uncached_fraction for load in loads)
    backlog = sum(load.uncached_tokens_waiting for load in loads)
    kv = sum(load.kv_cache_usage for load in loads) / len(loads)
    kv_used = kv * current  # in replicas' worth of KV cache (a replica yet to publish at the mean)
    preemptions = sum(load.preemptions_per_s for load in loads)
    figures = {"demand_tokens_per_s": demand, "backlog_tokens": backlog, "kv_cache_usage": kv}

    keep_up = _replicas_for(demand, cfg.target_utilization * mu)
    # What the running replicas clear before a new one could serve is not a reason to start one.
    backlog_left = max(0.0, backlog - max(0.0, current * mu - demand) * cfg.replica_startup_s)
    clear_backlog = _replicas_for(demand + backlog_left / budget, mu)
    ongoing = None if requests is None else max(0.0, requests - queued)
    seats = _seats_for(ongoing, cfg.target_utilization * cfg.max_ongoing_requests)
    if queued > 0:
        # Seats for every request at once are the most a queue can use (more replicas would idle);
        # they also bound a drain rate read low while the first long replies are still running.
        seats = max(seats, min(_to_drain_queue(loads, cfg, current, queued, queue_growth_per_s),
                               _seats_for(requests, cfg.target_utilization * cfg.max_ongoing_requests)))
    wanted = max(keep_up, clear_backlog, seats)
    # KV: the mean usage lags (a preempted request's blocks are freed, and one replica fills while
    # the mean looks fine), so a preemption anywhere in the window is the cache being full.
    kv_short = kv >= cfg.kv_cache_high or preemptions > 0
    if kv_short:
        wanted = max(wanted, current + 1, _replicas_for(kv_used, cfg.kv_cache_high))
    if wanted > current:
        if wanted > max(keep_up, clear_backlog, seats):
            why = f"vLLM preempting {preemptions:.1f} requests/s" if preemptions > 0 else f"KV cache {kv:.0%} full"
        elif seats > max(keep_up, clear_backlog):
            why = f"{queued:.0f} requests queued for a free replica" if queued > 0 else \
                f"{ongoing:.0f} requests over {cfg.target_utilization:.0%} of the replicas' seats"
        else:
            why = "backlog over the TTFT budget" if clear_backlog > keep_up else "arrival rate over capacity"
        return Decision(wanted, f"scale up to {wanted}: {why}", **figures)
    if current > 1 and queued == 0:
        low = cfg.downscale_utilization * mu
        enough = max(_replicas_for(demand, low), _replicas_for(demand + backlog / budget, low))
        enough = max(enough, math.ceil(kv_used / cfg.kv_cache_low - 1e-9),
                     _seats_for(requests, cfg.downscale_utilization * cfg.max_ongoing_requests), 1)
        if enough < current:
            return Decision(enough, f"scale down to {enough}: {enough} replicas meet the budget below "
                                    f"{cfg.downscale_utilization:.0%} load", **figures)
    return Decision(current, "holding", **figures)


def loads_from_metrics(aggregated: dict[str, dict[Any, float]] | None, replicas: list) -> list[ReplicaLoad]:
    """One :class:`ReplicaLoad` per running replica that has published figures, from Serve's
    ``AutoscalingContext.aggregated_metrics`` (``{metric: {replica_id: value}}``)."""
    aggregated = aggregated or {}
    loads = []
    for replica in replicas:
        metrics = {name: per_replica[replica] for name, per_replica in aggregated.items() if replica in per_replica}
        if metrics:
            loads.append(ReplicaLoad.from_metrics(metrics))
    return loads


QUEUE_SAMPLE_S, QUEUE_WINDOW_S = 1.0, 10.0


def _queue_growth(samples: list[list[float]], now: float, queued: float) -> tuple[list[list[float]], float]:
    """The queue's samples (one a second over the last ten, kept in the policy's state between
    ticks) with ``queued`` at ``now`` added, and its growth per second over them."""
    if not samples or now - samples[-1][0] >= QUEUE_SAMPLE_S:
        samples = [*samples, [now, queued]]
    samples = [sample for sample in samples if sample[0] >= now - QUEUE_WINDOW_S]
    t0, q0 = samples[0]
    return samples, (queued - q0) / (now - t0) if now - t0 >= QUEUE_SAMPLE_S else 0.0


class PrefillAutoscalingPolicy:
    """Serve's class-form custom policy: built once on the controller with ``policy_kwargs``, then
    called every control tick with an ``AutoscalingContext``. Non-blocking: arithmetic only."""

    def __init__(self, **policy_kwargs: Any) -> None:
        self.config = PrefillPolicyConfig.model_validate(policy_kwargs)

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        loads = loads_from_metrics(ctx.aggregated_metrics, list(ctx.running_replicas))
        state = dict(ctx.policy_state or {})
        now = ctx.current_time if ctx.current_time is not None else time.time()
        samples, growth = _queue_growth(state.get("queue_samples", []), now, ctx.total_queued_requests)
        decision = decide(loads, ctx.current_num_replicas, self.config, ctx.total_num_requests,
                          ctx.total_queued_requests, growth)
        target, reason = decision.replicas, decision.reason
        if ctx.current_num_replicas < target < ctx.target_num_replicas:
            # Still short of the replicas already asked for: keep them coming. Serve stops starting
            # replicas first when the target drops, so a wish that wavers while they start (the
            # backlog's estimate moves) would throw away start-ups half paid and never catch up.
            target = ctx.target_num_replicas
            reason = f"{reason}; keeps the {target} asked for while {target - ctx.current_num_replicas} start"
        # Serve bounds the answer anyway; bounding it here too makes the log (and policy_state) say
        # what will happen, and a wish that keeps moving above max_replicas log nothing new.
        wish = target
        target = min(max(target, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
        if target != wish:
            reason = f"{reason} (wants {wish}; bounds {ctx.capacity_adjusted_min_replicas}-" \
                     f"{ctx.capacity_adjusted_max_replicas} give {target})"
        # Log a change of target once, not every 0.1 s tick it persists.
        wish = target if target != ctx.current_num_replicas else None
        if wish is not None and state.get("logged_wish") != wish:
            log.info("swiftkv autoscaling %s: %s (demand %.0f tok/s, backlog %.0f tok, KV %.0f%%)",
                     ctx.deployment_name, reason, decision.demand_tokens_per_s,
                     decision.backlog_tokens, 100 * decision.kv_cache_usage)
        state.update(logged_wish=wish, last_reason=reason, queue_samples=samples,
                     demand_tokens_per_s=decision.demand_tokens_per_s, backlog_tokens=decision.backlog_tokens,
                     kv_cache_usage=decision.kv_cache_usage)
        return target, state
