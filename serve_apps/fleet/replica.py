"""One simulated replica: vLLM's engine as its chunked-prefill scheduler steps, a KV cache of
prefix blocks with LRU eviction, and the real :class:`~serve_apps.load.LoadTracker` turning what
happens into the figures a real replica publishes.

Each engine step runs every decoding sequence one token (decode first, as vLLM does) and fills the
rest of the token budget with prefill chunks, oldest request first; it lasts
``decode_step_s(batch, context) + sum(chunk / prefill_rate(prompt length))``. A prompt whose last
chunk is in a step gets its first token when the step ends, together with every other prompt
finishing there; requests arriving during a step join at the next one. Steps that would repeat
identically (decode only, or one prompt taking the whole budget) run as one event, so the replica
jumps from change to change instead of simulating every step; an arrival during a decode-only run
cuts it at the next step boundary. A run's steps last ``pace()`` times that (the fleet's shared-host
slowdown, read when the run starts).

A request is admitted (at a step boundary) when its prompt's blocks, shared with any other request
holding them, fit beside what the running requests hold and their next step's tokens, and the
sequence cap allows; until then it waits in the engine's queue, as in vLLM. Generated tokens take
KV as they are produced (counted in tokens: vLLM's blocks are 16 tokens, the trace's prefix blocks
far larger). When the next step's tokens do not fit, the newest running request is preempted, as
vLLM's scheduler does: its KV is freed (its prompt's blocks stay cached until evicted), it goes back
to the head of the queue, and when admitted again it recomputes its prompt and the tokens it had
produced (less the prompt's cached prefix) before it decodes on. A request alone always runs.
Blocks no running request holds stay cached until evicted, least recently used first. A prompt is
served from that cache up to its longest run of leading blocks present (vLLM computes at least the
last prompt token).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from serve_apps.fleet.profile import ModelFigures, ReplicaCosts
from serve_apps.load import LoadTracker, ReplicaLoad

EPS = 1e-6


@dataclass(eq=False)
class SimRequest:
    """A request and what happened to it."""

    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]
    routed_s: float | None = None
    replica: int | None = None
    uncached_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    remaining: float = 0.0  # prefill tokens still to compute
    produced: int = 0  # output tokens out before its latest admission (a preempted request's)
    preemptions: int = 0
    recomputed_tokens: int = 0  # prefill computed again after preemptions
    order: int = 0  # admission order on its replica: the newest running request is preempted first
    base_step: float = 0.0  # while decoding: its output tokens so far are the replica's steps minus this

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


class Replica:
    """One replica's engine between ``ready_s`` and its stop."""

    def __init__(self, number: int, figures: ModelFigures, costs: ReplicaCosts, capacity: float, block_tokens: int,
                 started_s: float, ready_s: float, pace: Callable[[], float] = lambda: 1.0) -> None:
        self.number = number
        self.costs = costs
        self.pace = pace
        self.budget = figures.max_num_batched_tokens
        self.max_seqs = figures.max_num_seqs
        self.block_tokens = block_tokens
        self.capacity_blocks = max(1, figures.kv_cache_tokens // block_tokens)
        self.started_s, self.ready_s = started_s, ready_s
        self.stopped_s: float | None = None
        self.tracker = LoadTracker(capacity)  # the calibrated figure it publishes
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: deque[SimRequest] = deque()
        self.decoding: list[tuple[float, int, SimRequest]] = []  # heap on finish step
        self.steps = 0.0
        self.context_tokens = 0.0  # of the decoding sequences, together
        self.queued_prompt_tokens = 0  # whole prompts of requests before their first token
        self.pins: dict[int, int] = {}  # block -> running requests holding it
        self.cache: OrderedDict[int, None] = OrderedDict()  # blocks nobody holds, oldest first
        self.private_blocks = 0  # prompt blocks without a hash
        self.capacity_tokens = self.capacity_blocks * block_tokens
        # Generated tokens held: by decoding sequences, len(decoding) * steps - base_steps; by
        # preempted requests admitted again and still recomputing, resumed_tokens.
        self.base_steps = 0.0
        self.resumed_tokens = 0
        self.admissions = 0
        # The run in progress: (start, seconds per step, steps, [(request, prefill tokens per step)]).
        self.run: tuple[float, float, int, list[tuple[SimRequest, int]]] | None = None

    # -- what the rest of the fleet reads -------------------------------------------------------
    @property
    def ongoing(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)

    @property
    def kv_usage(self) -> float:
        return min(1.0, self._used_tokens() / self.capacity_tokens)

    def _generated_tokens(self) -> float:
        return len(self.decoding) * self.steps - self.base_steps + self.resumed_tokens

    def _used_tokens(self) -> float:
        return (len(self.pins) + self.private_blocks) * self.block_tokens + self._generated_tokens()

    def load(self, now: float) -> ReplicaLoad:
        """The figures this replica publishes now (the real tracker's snapshot)."""
        self.tracker.on_scheduler(len(self.prefilling) + len(self.decoding), len(self.waiting), self.kv_usage)
        return self.tracker.snapshot(now, float(self.queued_prompt_tokens))

    # -- the engine -----------------------------------------------------------------------------
    def _plan(self, now: float) -> None:
        """Start the next run of identical steps at ``now`` (or go idle), preempting first while the
        next step's tokens do not fit."""
        while self.decoding and len(self.decoding) + len(self.prefilling) > 1 \
                and self._used_tokens() + len(self.decoding) > self.capacity_tokens:
            self._preempt_newest()
        batch = len(self.decoding)
        pace = self.pace()
        decode_s = self.costs.decode_step_s(batch, self.context_tokens)
        room = max(0, self.budget - batch)
        until_decode_done = max(1, math.ceil(self.decoding[0][0] - self.steps - EPS)) if self.decoding else math.inf
        if batch and batch + len(self.prefilling) > 1:
            # The run ends where the cache would overflow; the next plan preempts.
            fit = int((self.capacity_tokens - self._used_tokens()) // batch)
            until_decode_done = min(until_decode_done, max(1, fit))
        chunks: list[tuple[SimRequest, int]] = []
        if self.prefilling and room:
            head = self.prefilling[0]
            if head.remaining > room:  # the head takes the whole budget, step after step
                count = min(math.ceil(head.remaining / room) - 1, until_decode_done)
                step_s = decode_s + room / self.costs.prefill_rate(head.input_tokens + head.produced)
                self.run = (now, step_s * pace, count, [(head, room)])
                return
            for request in self.prefilling:
                take = min(request.remaining, room)
                chunks.append((request, take))
                room -= take
                if not room:
                    break
        if not chunks and not batch:
            self.run = None
            return
        seconds = decode_s + sum(take / self.costs.prefill_rate(r.input_tokens + r.produced) for r, take in chunks)
        self.run = (now, seconds * pace, 1 if chunks else until_decode_done, chunks)

    def next_event_s(self) -> float:
        """When the run in progress ends (``inf`` when idle)."""
        if self.run is None:
            return math.inf
        start, seconds, count, _ = self.run
        return start + seconds * count

    def add(self, request: SimRequest, now: float) -> None:
        """A request routed here: it joins the engine's queue, taken up at the next step."""
        request.replica = self.number
        self.waiting.append(request)
        self.queued_prompt_tokens += request.input_tokens
        if self.run is None:
            self._admit()
            self._plan(now)
        elif not self.run[3]:  # decode only: the new prompt joins at the next step boundary
            start, seconds, count, _ = self.run
            done = min(count, math.ceil((now - start) / seconds - EPS))
            if done <= 0:
                self.run = None
                self._admit()
                self._plan(now)
            else:
                self.run = (start, seconds, done, [])

    def on_event(self, t: float) -> list[SimRequest]:
        """The run ends at ``t``: settle what finished, admit, start the next run; returns the requests
        that finished."""
        _, _, count, chunks = self.run
        self.steps += count
        self.context_tokens += len(self.decoding) * count
        for request, take in chunks:
            request.remaining -= take * count
        finished = []
        while self.prefilling and self.prefilling[0].remaining <= EPS:
            request = self.prefilling.popleft()
            if request.first_token_s is None:
                request.first_token_s = t
                self.queued_prompt_tokens -= request.input_tokens
                self.tracker.on_prefill_done(request.input_tokens, request.uncached_tokens)
                self.tracker.on_first_tokens(t, [t - request.routed_s])
            self.resumed_tokens -= request.produced
            produced = request.produced + 1  # the prefill's step produces a token
            if produced >= request.output_tokens:
                finished.append(self._release(request, t))
            else:
                self.context_tokens += request.input_tokens + produced
                request.base_step = self.steps - produced
                self.base_steps += request.base_step
                # keyed by the engine step at which its last token is out
                heapq.heappush(self.decoding, (self.steps + request.output_tokens - produced, request.index, request))
        while self.decoding and self.decoding[0][0] <= self.steps + EPS:
            _, _, request = heapq.heappop(self.decoding)
            self.context_tokens -= request.input_tokens + request.output_tokens
            self.base_steps -= request.base_step
            finished.append(self._release(request, t))
        if not self.decoding:
            self.context_tokens = self.base_steps = 0.0  # no drift from rounding
        self._admit()
        self._plan(t)
        return finished

    # -- KV cache -------------------------------------------------------------------------------
    def _cached_prefix(self, request: SimRequest) -> int:
        matched = 0
        for block in request.blocks:
            if block not in self.pins and block not in self.cache:
                break
            matched += 1
        cached = min(matched * self.block_tokens, request.input_tokens)
        return min(cached, request.input_tokens - 1)  # the last prompt token is always computed

    def _own_blocks(self, request: SimRequest) -> int:
        """Prompt blocks the trace gives no hash (nobody shares them)."""
        return max(0, math.ceil(request.input_tokens / self.block_tokens) - len(request.blocks))

    def _admit(self) -> None:
        while self.waiting and len(self.prefilling) + len(self.decoding) < self.max_seqs:
            request = self.waiting[0]
            new = sum(1 for b in set(request.blocks) if b not in self.pins) + self._own_blocks(request)
            need = self._used_tokens() + new * self.block_tokens + request.produced + len(self.decoding) + 1
            if need > self.capacity_tokens and (self.prefilling or self.decoding):
                return  # wait for room (a request alone always runs)
            self.waiting.popleft()
            cached = self._cached_prefix(request)
            if request.preemptions:
                request.recomputed_tokens += request.input_tokens + request.produced - cached
                self.resumed_tokens += request.produced
            else:
                request.uncached_tokens = request.input_tokens - cached
            request.remaining = float(request.input_tokens + request.produced - cached)
            request.order = self.admissions
            self.admissions += 1
            for block in request.blocks:
                self.cache.pop(block, None)
                self.pins[block] = self.pins.get(block, 0) + 1
            self.private_blocks += self._own_blocks(request)
            self._evict()
            self.prefilling.append(request)

    def _preempt_newest(self) -> None:
        """Free the newest running request's KV and put it back at the head of the queue."""
        running = [*self.prefilling, *(entry[2] for entry in self.decoding)]
        request = max(running, key=lambda r: r.order)
        if request in self.prefilling:
            self.prefilling.remove(request)
            self.resumed_tokens -= request.produced
        else:
            self.decoding = [entry for entry in self.decoding if entry[2] is not request]
            heapq.heapify(self.decoding)
            produced = int(round(self.steps - request.base_step))
            self.base_steps -= request.base_step
            self.context_tokens -= request.input_tokens + produced
            request.produced = produced
        request.preemptions += 1
        self.tracker.on_preempted(1)
        self._unpin(request)
        self.waiting.appendleft(request)

    def _release(self, request: SimRequest, t: float) -> SimRequest:
        request.finish_s = t
        self.tracker.on_finished(1)
        self._unpin(request)
        return request

    def _unpin(self, request: SimRequest) -> None:
        self.private_blocks -= self._own_blocks(request)
        for block in request.blocks:
            holders = self.pins[block] - 1
            if holders:
                self.pins[block] = holders
            else:
                del self.pins[block]
                self.cache[block] = None
        self._evict()

    def _evict(self) -> None:
        held = len(self.pins) + self.private_blocks + math.ceil(self._generated_tokens() / self.block_tokens - EPS)
        while self.cache and len(self.cache) > max(0, self.capacity_blocks - held):
            self.cache.popitem(last=False)
