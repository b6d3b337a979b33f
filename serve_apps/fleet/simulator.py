"""The event loop: requests arrive, pass the endpoint's front end, Serve's router places them,
replicas run them, replicas publish their load, Serve's autoscaling policy resizes the fleet, new
replicas come up after their start-up time and replicas told to stop drain first.

Everything runs on one simulated clock inside one asyncio loop (Serve's router classes create tasks
and await; nothing here sleeps), so a run is deterministic for a given config and seed.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ray.serve._private.common import ReplicaID

from serve_apps.config import ModelOptions
from serve_apps.fleet.config import FleetConfig
from serve_apps.fleet.profile import Profile, ReplicaCosts
from serve_apps.fleet.replica import Replica, SimRequest
from serve_apps.fleet.serve_control import Autoscaler, Router, SimReplicaHandle
from serve_apps.fleet.trace import Trace

# Event kinds, in the order they are handled when they fall at the same time.
READY, REPLICA, ARRIVAL, METRICS, STATS, CONTROL, TIMELINE, DEADLINE = range(8)


@dataclass
class RunResult:
    """What happened in one run."""

    requests: list[SimRequest]
    replicas: list[tuple[float, float]]  # (started, stopped) of every replica
    scale_events: list[tuple[float, int, int]]  # (time, old target, new target)
    timeline: list[dict[str, float]]  # every timeline period: replicas alive, ready, target, queued
    end_s: float
    initial_replicas: int
    idle_ttft_s: list[float]  # each request's prefill time alone on an idle replica (its best TTFT)
    stopped_early: bool = False  # the miss budget ran out: a partial run


class Simulation:
    """One fleet run (see :func:`simulate`)."""

    def __init__(self, cfg: FleetConfig, trace: Trace, profile: Profile,
                 progress: Callable[[float], None] | None = None, miss_budget: int | None = None) -> None:
        self.cfg = cfg
        self.figures = profile.figures(cfg.model)
        self.costs = ReplicaCosts.from_figures(self.figures)
        self.block_tokens = trace.block_tokens
        self.startup_s = self.figures.startup_s if cfg.startup_s is None else cfg.startup_s
        self.capacity = (self.figures.prefill_tokens_per_s if cfg.capacity_input_tokens is None
                         else self.costs.prefill_rate(cfg.capacity_input_tokens))
        # The deployment's options as in a serve config: the policy and router get them from here.
        options = ModelOptions(name="fleet", model=self.figures.model, prefill_tokens_per_s=self.capacity,
                               max_ongoing_requests=cfg.max_ongoing_requests, autoscaling=cfg.autoscaling,
                               routing=cfg.routing)
        self.autoscaler = None if cfg.static_replicas else Autoscaler(options)
        self.router = Router(options, clock=lambda: self.now)
        self.requests = [SimRequest(i, r.arrival_s, r.input_tokens, max(1, r.output_tokens), r.blocks)
                         for i, r in enumerate(trace.requests)]
        self.progress = progress
        self.idle_ttft = [self.costs.idle_ttft_s(r.input_tokens) for r in self.requests]
        # When each request reaches the router: through the front end, one at a time for ``ingress_s``
        # each, then ``ingress_latency_s`` more in parallel.
        self.routable_at: list[float] = []
        free = 0.0
        for request in self.requests:
            free = max(request.arrival_s, free) + cfg.ingress_s
            self.routable_at.append(free + cfg.ingress_latency_s)
        self.miss_budget = miss_budget
        self.misses = 0
        self.missed: set[int] = set()  # requests counted as misses at their deadline
        self.now = 0.0
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.replicas: dict[int, Replica] = {}
        self.handles: dict[int, SimReplicaHandle] = {}
        self.versions: dict[int, int] = {}
        self.starting: list[int] = []
        self.routable: list[int] = []
        self.draining: set[int] = set()
        self.pending: deque[SimRequest] = deque()
        self.samples: dict[ReplicaID, deque[tuple[float, dict[str, float]]]] = {}
        self.totals: deque[tuple[float, float, float]] = deque()  # (time, requests, of which queued)
        self.scale_events: list[tuple[float, int, int]] = []
        self.timeline: list[dict[str, float]] = []
        self.finished = 0
        self.all_finished_s: float | None = None  # when the last request finished
        self.target = cfg.static_replicas or cfg.autoscaling.initial_replicas or cfg.autoscaling.min_replicas
        self.initial_replicas = self.target
        self.last_arrival = self.requests[-1].arrival_s if self.requests else 0.0

    # -- the event queue ------------------------------------------------------------------------
    def push(self, t: float, kind: int, payload: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, payload))

    def reschedule(self, replica: Replica) -> None:
        version = self.versions[replica.number] = self.versions.get(replica.number, 0) + 1
        t = replica.next_event_s()
        if math.isfinite(t):
            self.push(t, REPLICA, (replica.number, version))

    # -- replicas -------------------------------------------------------------------------------
    def start_replica(self, ready_in_s: float) -> None:
        number = len(self.replicas)
        replica = Replica(number, self.figures, self.costs, self.capacity, self.block_tokens, self.now,
                          self.now + ready_in_s, functools.partial(self.pace, number))
        self.replicas[number] = replica
        self.handles[number] = SimReplicaHandle(replica, self.cfg.max_ongoing_requests)
        self.starting.append(number)
        self.push(replica.ready_s, READY, number)

    def pace(self, number: int) -> float:
        """How long replica ``number``'s steps take against the profile's: ``shared_host_slowdown``
        while every other ready replica (draining ones too) is busy, the host then having no idle core
        for the serving stack; 1 otherwise."""
        if self.cfg.shared_host_slowdown == 1.0:
            return 1.0
        others = [r for n, r in self.replicas.items() if n != number and r.stopped_s is None and n not in self.starting]
        return self.cfg.shared_host_slowdown if all(r.run is not None for r in others) else 1.0

    def stop_replicas(self, count: int) -> None:
        """Serve stops starting replicas first (newest first), then running ones; here the running
        replicas with the fewest ongoing requests, which drain before they go."""
        while count and self.starting:
            number = self.starting.pop()
            self.replicas[number].stopped_s = self.now
            count -= 1
        if count:
            victims = sorted(self.routable, key=lambda n: (self.replicas[n].ongoing, -n))[:count]
            for number in victims:
                self.routable.remove(number)
                self.draining.add(number)
                self._retire_if_idle(number)
            self.router.update_replicas([self.handles[n] for n in self.routable])

    def _retire_if_idle(self, number: int) -> None:
        if number in self.draining and self.replicas[number].ongoing == 0:
            self.draining.discard(number)
            self.replicas[number].stopped_s = self.now
            self.samples.pop(self.handles[number].replica_id, None)

    # -- requests -------------------------------------------------------------------------------
    async def dispatch(self) -> None:
        """Route waiting requests in arrival order while the router finds room (Serve's FIFO)."""
        while self.pending and self.routable:
            request = self.pending[0]
            handle = await self.router.route(request, self.block_tokens)
            if handle is None:
                return
            self.pending.popleft()
            request.routed_s = self.now
            handle.replica.add(request, self.now)
            self.reschedule(handle.replica)

    # -- periodic work --------------------------------------------------------------------------
    def publish_metrics(self) -> None:
        window = self.cfg.autoscaling.look_back_period_s
        for number in self.routable:
            rid = self.handles[number].replica_id
            series = self.samples.setdefault(rid, deque())
            series.append((self.now, self.replicas[number].load(self.now).to_metrics()))
            while series[0][0] < self.now - window:
                series.popleft()
        total = sum(self.replicas[n].ongoing for n in self.routable) + len(self.pending)
        self.totals.append((self.now, float(total), float(len(self.pending))))
        while self.totals[0][0] < self.now - window:
            self.totals.popleft()

    def publish_routing_stats(self) -> None:
        for number in self.routable:
            self.handles[number].routing_stats = self.replicas[number].load(self.now).to_metrics()

    def control(self) -> None:
        running = [self.handles[n].replica_id for n in self.routable]
        metrics: dict[str, dict[ReplicaID, float]] = {}
        for rid in running:
            series = self.samples.get(rid)
            if not series:
                continue
            for name in series[0][1]:
                metrics.setdefault(name, {})[rid] = sum(s[1][name] for s in series) / len(series)
        # Serve's totals: requests at the replicas and queued at the handles, and the queued alone,
        # each averaged over the look-back window.
        n = max(1, len(self.totals))
        total, queued = (sum(sample[i] for sample in self.totals) / n for i in (1, 2))
        target = self.autoscaler.decide(self.now, running, self.target, metrics, total, queued)
        if target == self.target:
            return
        self.scale_events.append((self.now, self.target, target))
        alive = len(self.starting) + len(self.routable)
        if target > alive:
            for _ in range(target - alive):
                self.start_replica(self.startup_s)
        elif target < alive:
            self.stop_replicas(alive - target)
        self.target = target

    def record_timeline(self) -> None:
        self.timeline.append({"t": self.now, "replicas": len(self.starting) + len(self.routable) + len(self.draining),
                              "ready": len(self.routable), "target": self.target, "queued": len(self.pending)})

    # -- the loop -------------------------------------------------------------------------------
    def done(self) -> bool:
        if self.finished == len(self.requests) and self.all_finished_s is None:
            self.all_finished_s = self.now
        idle_for = self.now - self.all_finished_s if self.all_finished_s is not None else -1.0
        return (idle_for >= self.cfg.idle_tail_s or self.now > self.last_arrival + self.cfg.tail_limit_s
                or self.stopped_early)

    @property
    def stopped_early(self) -> bool:
        return self.miss_budget is not None and self.misses > self.miss_budget

    def count_misses(self, finished: list[SimRequest]) -> None:
        """Scored requests an idle replica would have answered within the SLO but this fleet did not."""
        slo = self.cfg.slo_ttft_s
        self.misses += sum(1 for r in finished if r.ttft_s > slo and self.idle_ttft[r.index] <= slo
                           and r.index not in self.missed and r.arrival_s >= self.cfg.score_from_s)

    def deadline(self, index: int) -> None:
        """A feasible request's SLO has passed: without a first token by now it has missed, whether it
        waits at the router or in an engine's queue (a saturated fleet stops early, not hours later)."""
        if self.requests[index].first_token_s is None:
            self.missed.add(index)
            self.misses += 1

    async def run(self) -> RunResult:
        cfg = self.cfg
        for _ in range(self.target):
            self.start_replica(0.0)
        if self.requests:
            self.push(self.routable_at[0], ARRIVAL, 0)
        # Figures nobody reads are not computed: a static fleet has no autoscaler, and Serve's
        # power-of-two router reads no routing stats.
        if self.autoscaler:
            self.push(0.0, METRICS)
            self.push(cfg.control_interval_s, CONTROL)
        if cfg.routing.router == "prefill":
            self.push(0.0, STATS)
        self.push(0.0, TIMELINE)
        periods = {METRICS: cfg.autoscaling.metrics_interval_s, STATS: self.router.stats_period_s,
                   CONTROL: cfg.control_interval_s, TIMELINE: cfg.timeline_period_s}
        next_progress = 0.0
        while self.events and not self.done():
            self.now, kind, _, payload = heapq.heappop(self.events)
            if kind == ARRIVAL:
                self.pending.append(self.requests[payload])
                if payload + 1 < len(self.requests):
                    self.push(self.routable_at[payload + 1], ARRIVAL, payload + 1)
                if self.miss_budget is not None and self.idle_ttft[payload] <= cfg.slo_ttft_s \
                        and self.requests[payload].arrival_s >= cfg.score_from_s:
                    self.push(self.requests[payload].arrival_s + cfg.slo_ttft_s, DEADLINE, payload)
                await self.dispatch()
            elif kind == REPLICA:
                number, version = payload
                if self.versions.get(number) != version:
                    continue
                replica = self.replicas[number]
                finished = replica.on_event(self.now)
                for request in finished:
                    self.router.on_finished(self.handles[number], request)
                self.finished += len(finished)
                self.count_misses(finished)
                self.reschedule(replica)
                self._retire_if_idle(number)
                if finished:
                    await self.dispatch()
            elif kind == READY:
                if self.replicas[payload].stopped_s is None and payload in self.starting:
                    self.starting.remove(payload)
                    self.routable.append(payload)
                    self.router.update_replicas([self.handles[n] for n in self.routable])
                    await self.dispatch()
            elif kind == DEADLINE:
                self.deadline(payload)
            else:
                {METRICS: self.publish_metrics, STATS: self.publish_routing_stats, CONTROL: self.control,
                 TIMELINE: self.record_timeline}[kind]()
                self.push(self.now + periods[kind], kind)
            if self.progress and self.now >= next_progress:
                self.progress(self.now)
                next_progress = self.now + 60.0
        end = self.now
        for replica in self.replicas.values():
            if replica.stopped_s is None:
                replica.stopped_s = end
        return RunResult(self.requests, [(r.started_s, r.stopped_s) for r in self.replicas.values()],
                         self.scale_events, self.timeline, end, self.initial_replicas, self.idle_ttft,
                         self.stopped_early)


def simulate(cfg: FleetConfig, trace: Trace, profile: Profile, progress: Callable[[float], None] | None = None,
             miss_budget: int | None = None) -> RunResult:
    """Replay ``trace`` through the fleet ``cfg`` describes; stop early once more than ``miss_budget``
    requests that could have met the SLO have missed it (a fleet search needs only pass or fail)."""
    random.seed(cfg.seed)  # Serve's power-of-two router draws from the global generator
    simulation = Simulation(cfg, trace, profile, progress, miss_budget)
    return asyncio.run(simulation.run())
