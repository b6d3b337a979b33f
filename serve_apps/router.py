"""Routing on prefill load: each request goes to the replica with the lowest estimated time to first
token, preferring the replica that already holds the prompt's prefix until its estimate exceeds the
best other one's by a margin: a set one, or less, the prefill time that prefix saves (a system
prompt every request shares must not herd them all onto one replica).

A replica's estimate is ``(uncached tokens waiting + tokens this router sent it since its figures
were taken + this prompt's uncached tokens) / its calibrated prefill rate``. The waiting tokens come
from the replica's own published :class:`~serve_apps.load.ReplicaLoad` (``record_routing_stats``);
the router adds what it has sent since (and shortly before: a replica's engine counts a prompt a
moment after the replica accepts it), because those figures are up to a stats period old, counting
a prompt as soon as it ranks a replica first (Serve confirms the choice only after the replica has
accepted, a round trip later, and meanwhile ranks the rest of a burst). Prefix
ownership is remembered locally (which replica last got each prefix block), so nothing here waits
on another process: ``choose_replicas`` never blocks.

:class:`PrefillRouterCore` is the pure part (the fleet simulator drives it directly);
:class:`PrefillAwareRouter` is Serve's ``RequestRouter`` around it. It returns one replica per rank,
so Serve's own queue-length re-pick within a rank cannot undo the order.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from serve_apps.hints import PromptHint
from serve_apps.load import ReplicaLoad


class PrefillRouterConfig(BaseModel):
    """The prefill-aware router's settings (``request_router_kwargs``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    prefill_tokens_per_s: float = Field(default=1000.0, gt=0)
    """Prefill rate assumed for a replica that has not published its calibrated one yet."""

    prefix_margin_s: float = Field(default=1.0, ge=0)
    """Keep a prompt on the replica holding its prefix until that replica's estimated TTFT exceeds
    the best other replica's by more than this many seconds, or by more than the prefill time the
    cached prefix saves if that is less."""

    admission_s: float = Field(default=0.5, ge=0)
    """How long after a prompt is sent a replica's figures may still leave it out (Serve's accept,
    then vLLM's parsing: the engine counts a prompt only once its handler starts generating). The
    router keeps counting the prompt until figures taken this much later than the send."""

    tie_s: float = Field(default=0.05, ge=0)
    """Estimates within this many seconds of the best count as equal to it: among them the replica
    with the emptier KV cache, then the fewer requests, ranks first (ranking on prefill alone sent
    every request to the first of the replicas with nothing waiting, which then held all the
    decoding and preempted)."""

    sent_memory_s: float = Field(default=30.0, gt=0)
    """Forget tokens this router sent a replica after this long even if no newer figures came."""

    max_prefix_blocks: int = Field(default=200_000, gt=0)
    """Prefix blocks remembered (least recently used forgotten first)."""


@dataclass(frozen=True)
class Estimate:
    replica: Hashable
    ttft_s: float
    cached_blocks: int
    saved_s: float = 0.0  # prefill time the replica's cached prefix of the prompt saves


class PrefillRouterCore:
    """Ranks replicas for a request; remembers what it sent where."""

    def __init__(self, config: PrefillRouterConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self._sent: dict[Hashable, deque[list[float]]] = {}  # replica -> [time, tokens] entries
        # request -> (replica, its entry in _sent): counted at its first choice, not yet confirmed
        self._tentative: OrderedDict[Hashable, tuple[Hashable, list[float]]] = OrderedDict()
        self._prefix_owner: OrderedDict[int, Hashable] = OrderedDict()

    def _cached_blocks(self, hint: PromptHint) -> dict[Hashable, int]:
        """For each replica that was the last to be sent some prefix of the prompt, the longest
        such prefix in blocks (chained hashes: block i stands for the whole prefix up to and
        including it). One pass over the blocks, whatever the number of replicas."""
        matched: dict[Hashable, int] = {}
        for i, block in enumerate(hint.prefix_blocks, start=1):
            owner = self._prefix_owner.get(block)
            if owner is not None:
                matched[owner] = i
        return matched

    def _sent_since(self, replica: Hashable, since: float, now: float) -> float:
        sent = self._sent.get(replica)
        if not sent:
            return 0.0
        # A replica's figures only get newer, so what was sent well before them is never counted again.
        oldest = max(now - self.config.sent_memory_s, since - self.config.admission_s)
        while sent and sent[0][0] < oldest:
            sent.popleft()
        return sum(tokens for _, tokens in sent)

    def estimate(self, replica: Hashable, load: ReplicaLoad, hint: PromptHint, now: float,
                 cached: int | None = None) -> Estimate:
        """``cached``: the replica's prefix blocks of this prompt when the caller already knows them."""
        rate = load.prefill_capacity or self.config.prefill_tokens_per_s
        if cached is None:
            cached = self._cached_blocks(hint).get(replica, 0)
        own = max(0.0, hint.prompt_tokens - cached * hint.block_tokens)
        pending = load.uncached_tokens_waiting + self._sent_since(replica, load.timestamp, now)
        return Estimate(replica, (pending + own) / rate, cached, (hint.prompt_tokens - own) / rate)

    def rank(self, replicas: list[tuple[Hashable, ReplicaLoad]], hint: PromptHint) -> list[Hashable]:
        """Replica ids, best first."""
        now = self.clock()
        cached = self._cached_blocks(hint)
        loads = dict(replicas)
        estimates = [self.estimate(r, load, hint, now, cached.get(r, 0)) for r, load in replicas]
        tied = min((e.ttft_s for e in estimates), default=0.0) + self.config.tie_s

        def order(e: Estimate) -> tuple[int, float, float, float]:
            if e.ttft_s > tied:
                return 1, e.ttft_s, 0.0, 0.0
            load = loads[e.replica]
            return 0, load.kv_cache_usage, load.running_requests + load.waiting_requests, e.ttft_s

        estimates.sort(key=order)
        holders = [e for e in estimates if e.cached_blocks > 0]
        if holders:
            holder = max(holders, key=lambda e: e.cached_blocks)  # sorted: ties go to the faster one
            best_other = min((e.ttft_s for e in estimates if e.replica != holder.replica), default=float("inf"))
            if holder.ttft_s <= best_other + min(self.config.prefix_margin_s, holder.saved_s):
                estimates.remove(holder)
                estimates.insert(0, holder)
        return [e.replica for e in estimates]

    def record_sent(self, replica: Hashable, hint: PromptHint, request: Hashable | None = None) -> None:
        """Count ``hint``'s tokens against ``replica`` and make it the owner of the prompt's prefix.
        With ``request`` (a key) the count is tentative until :meth:`confirm` or :meth:`withdraw`."""
        now = self.clock()
        entry = [now, hint.prompt_tokens]
        self._sent.setdefault(replica, deque()).append(entry)
        if request is not None:
            stale = now - self.config.sent_memory_s
            while self._tentative and next(iter(self._tentative.values()))[1][0] < stale:
                self._tentative.popitem(last=False)  # never confirmed (cancelled, failed): let go
            self._tentative[request] = (replica, entry)
        for block in hint.prefix_blocks:
            self._prefix_owner[block] = replica
            self._prefix_owner.move_to_end(block)
        while len(self._prefix_owner) > self.config.max_prefix_blocks:
            self._prefix_owner.popitem(last=False)

    def withdraw(self, request: Hashable | None) -> Hashable | None:
        """Take back ``request``'s tentative count; the replica it was on, if any."""
        replica, entry = self._tentative.pop(request, (None, None))
        if entry is not None:
            entry[1] = 0.0
        return replica

    def confirm(self, request: Hashable | None, replica: Hashable, hint: PromptHint) -> None:
        """``request`` went to ``replica``: its tentative count stays if it was counted there, and
        moves there otherwise."""
        if self._tentative.get(request, (None,))[0] == replica:
            del self._tentative[request]
        else:
            self.withdraw(request)
            self.record_sent(replica, hint)

    def forget_replicas(self, alive: set[Hashable]) -> None:
        for replica in [r for r in self._sent if r not in alive]:
            del self._sent[replica]
        for block in [b for b, r in self._prefix_owner.items() if r not in alive]:
            del self._prefix_owner[block]


def _request_key(pending_request) -> Hashable | None:
    """Serve's id of a pending request (kept across its routing retries), if it has one."""
    metadata = getattr(pending_request, "metadata", None)
    return getattr(metadata, "internal_request_id", None)


def _forwarded(pending_request):
    args = getattr(pending_request, "args", None) or ()
    return args[0] if args else None


def request_hint(pending_request) -> PromptHint:
    """The :class:`PromptHint` the ingress attached to a forwarded request (empty if none)."""
    hint = getattr(_forwarded(pending_request), "hint", None)
    return hint if isinstance(hint, PromptHint) else PromptHint(0.0)


def last_if_avoided(ranked: list[Hashable], pending_request) -> list[Hashable]:
    """``ranked`` with the replicas a retried request must avoid (they failed it) moved to the end."""
    avoid = set(getattr(_forwarded(pending_request), "avoid_replicas", ()) or ())
    if not avoid:
        return ranked
    avoided = [r for r in ranked if getattr(r, "unique_id", r) in avoid]
    return [r for r in ranked if r not in avoided] + avoided


try:
    from ray.serve.request_router import RequestRouter
except ImportError:  # pure use (tests, the fleet simulator) without Serve
    RequestRouter = object


class PrefillAwareRouter(RequestRouter):
    """Serve's request router for the model deployments (``request_router_config``)."""

    def initialize_state(self, **kwargs) -> None:
        # Serve's own clock for routers (``get_curr_time_s``, time.time unless injected, as the
        # fleet simulator does), so the core and Serve's queue-length cache agree on the time.
        self.core = PrefillRouterCore(PrefillRouterConfig.model_validate(kwargs), self._get_curr_time_s)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        by_id = {r.replica_id: r for r in candidate_replicas}
        hint, key = request_hint(pending_request), _request_key(pending_request)
        self.core.withdraw(key)  # ranked again (a retry): not weighed down by its own count
        ranked = last_if_avoided(self.core.rank(
            [(r.replica_id, ReplicaLoad.from_metrics(r.routing_stats)) for r in candidate_replicas], hint),
            pending_request)
        # Serve calls on_request_routed only once the replica has accepted the request, a round trip
        # later, and ranks the other requests of a burst meanwhile: counted only then, a burst would
        # all go to the same replica. So the prompt counts against its first choice now, and moves if
        # Serve sends it elsewhere.
        if ranked and key is not None:
            self.core.record_sent(ranked[0], hint, key)
        return [[by_id[r]] for r in ranked]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        self.core.confirm(_request_key(pending_request), replica_id, request_hint(pending_request))

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        self.core.forget_replicas({r.replica_id for r in replicas})
