"""The prefill-aware request router as a pure function of replica load and of what it has sent, and
Serve's ``RequestRouter`` around it on a fake replica list."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID

from serve_apps.asgi import ForwardedRequest
from serve_apps.hints import PromptHint, prompt_hint
from serve_apps.load import ReplicaLoad
from serve_apps.router import PrefillAwareRouter, PrefillRouterConfig, PrefillRouterCore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def waiting(tokens: float, at: float = 1000.0, capacity: float = 1000.0) -> ReplicaLoad:
    return ReplicaLoad(prompt_tokens_waiting=tokens, prefill_capacity=capacity, timestamp=at)


def ids_prompt(n: int, start: int = 0) -> PromptHint:
    return prompt_hint({"prompt": list(range(start, start + n))})


@pytest.fixture
def core():
    clock = Clock()
    return PrefillRouterCore(PrefillRouterConfig(prefix_margin_s=1.0), clock), clock


def test_idle_replica_beats_one_with_a_long_prompt_queued(core):
    router, _ = core
    assert router.rank([("busy", waiting(8000)), ("idle", waiting(0))], ids_prompt(50)) == ["idle", "busy"]


def test_equal_estimates_go_to_the_emptier_replica(core):
    """Nothing waits anywhere: the replica with the emptier KV cache, then fewer requests, ranks first
    (on prefill alone the same replica won every tie and collected every decoding request)."""
    router, _ = core
    full = ReplicaLoad(kv_cache_usage=0.8, running_requests=30, prefill_capacity=1000.0, timestamp=1000.0)
    empty = ReplicaLoad(kv_cache_usage=0.1, running_requests=30, prefill_capacity=1000.0, timestamp=1000.0)
    fewer = ReplicaLoad(kv_cache_usage=0.1, running_requests=3, prefill_capacity=1000.0, timestamp=1000.0)
    assert router.rank([("full", full), ("empty", empty), ("fewer", fewer)], ids_prompt(50)) == \
        ["fewer", "empty", "full"]
    # 40 ms more prefill waiting is within the tie (50 ms): the emptier cache wins; 60 ms is not.
    for tokens, first in ((40, "emptier"), (60, "full")):
        emptier = ReplicaLoad(prompt_tokens_waiting=tokens, kv_cache_usage=0.1, prefill_capacity=1000.0,
                              timestamp=1000.0)
        assert router.rank([("full", full), ("emptier", emptier)], ids_prompt(50))[0] == first


def test_estimate_is_seconds_at_each_replicas_own_rate(core):
    router, _ = core
    # 3000 tokens at 6000 tok/s (0.5 s) beats 1000 tokens at 1000 tok/s (1 s).
    ranked = router.rank([("slow", waiting(1000, capacity=1000)), ("fast", waiting(3000, capacity=6000))],
                         ids_prompt(10))
    assert ranked == ["fast", "slow"]


def test_tokens_sent_since_the_figures_count(core):
    """Figures are up to a stats period old: what the router sent since is added, so a burst is spread."""
    router, clock = core
    replicas = [("a", waiting(0, at=clock.now)), ("b", waiting(0, at=clock.now))]
    clock.now += 0.1
    first = router.rank(replicas, ids_prompt(2000))[0]
    router.record_sent(first, ids_prompt(2000))
    second = router.rank(replicas, ids_prompt(2000, start=5000))[0]
    assert second != first
    # Figures taken just after the send may not hold it yet (the replica's engine has not queued it):
    # the router still adds it.
    clock.now += 0.2
    assert router.estimate(first, waiting(0, at=clock.now), ids_prompt(1), clock.now).ttft_s == pytest.approx(2.001)
    # Figures taken well after the send include it: the router stops adding it.
    clock.now += 1.0
    fresh = [(first, waiting(2000, at=clock.now)), (second, waiting(0, at=clock.now))]
    assert router.estimate(first, fresh[0][1], ids_prompt(1), clock.now).ttft_s == pytest.approx(2.001)


def test_forgets_sent_tokens_after_sent_memory(core):
    router, clock = core
    router.record_sent("a", ids_prompt(5000))
    clock.now += 31.0  # sent_memory_s is 30 s and no newer figures came
    assert router.estimate("a", waiting(0, at=0.0), ids_prompt(0), clock.now).ttft_s == 0.0


def test_prefix_holder_is_preferred_within_the_margin(core):
    router, _ = core
    shared = list(range(640))  # ten 64-token blocks
    router.record_sent("holder", prompt_hint({"prompt": shared}))
    followup = prompt_hint({"prompt": shared + [7, 8, 9]})
    # The holder is 0.5 s busier than the other, within the 1 s margin: keep the prefix there.
    loads = [("other", waiting(0, at=2000.0)), ("holder", waiting(500 + 640, at=2000.0))]
    estimate = router.estimate("holder", loads[1][1], followup, 2000.0)
    assert estimate.cached_blocks == 10 and estimate.ttft_s == pytest.approx((1140 + 3) / 1000)
    assert router.rank(loads, followup) == ["holder", "other"]


def test_prefix_holder_is_left_when_its_estimate_exceeds_the_margin(core):
    router, _ = core
    shared = list(range(640))
    router.record_sent("holder", prompt_hint({"prompt": shared}))
    loads = [("other", waiting(0, at=2000.0)), ("holder", waiting(5000, at=2000.0))]
    assert router.rank(loads, prompt_hint({"prompt": shared + [1]})) == ["other", "holder"]


def test_a_small_shared_prefix_does_not_herd_requests(core):
    """A system prompt every request shares (one block here) saves 0.064 s of prefill: its holder keeps
    a prompt only while it is at most that much worse, not the whole 1 s margin."""
    router, _ = core
    router.record_sent("holder", prompt_hint({"prompt": list(range(64))}))
    followup = prompt_hint({"prompt": list(range(64)) + [5] * 500})
    loads = [("other", waiting(0, at=2000.0)), ("holder", waiting(300, at=2000.0))]
    assert router.estimate("holder", loads[1][1], followup, 2000.0).saved_s == pytest.approx(0.064)
    assert router.rank(loads, followup) == ["other", "holder"]
    # 0.036 s slower than the other by its estimate, within the 0.064 s its prefix saves: it keeps it.
    loads = [("other", waiting(0, at=2000.0)), ("holder", waiting(100, at=2000.0))]
    holder, other = (router.estimate(name, load, followup, 2000.0) for name, load in reversed(loads))
    assert 0 < holder.ttft_s - other.ttft_s < holder.saved_s
    assert router.rank(loads, followup) == ["holder", "other"]


def test_chained_prefix_blocks_only_match_whole_prefixes(core):
    router, _ = core
    router.record_sent("a", prompt_hint({"prompt": list(range(128))}))
    same_second_block = prompt_hint({"prompt": [99] * 64 + list(range(64, 128))})
    assert router.estimate("a", waiting(0), same_second_block, 1000.0).cached_blocks == 0


def test_prefix_memory_is_bounded_and_dead_replicas_forgotten():
    router = PrefillRouterCore(PrefillRouterConfig(max_prefix_blocks=5), Clock())
    router.record_sent("a", ids_prompt(64 * 8))
    assert len(router._prefix_owner) == 5
    router.record_sent("b", ids_prompt(64 * 2, start=10_000))
    router.forget_replicas({"b"})
    assert set(router._prefix_owner.values()) == {"b"} and "a" not in router._sent


def test_chat_turns_share_prefix_blocks():
    turn1 = [{"role": "system", "content": "You are terse. " * 40}, {"role": "user", "content": "Hi " * 100}]
    turn2 = turn1 + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More " * 50}]
    a, b = prompt_hint({"messages": turn1}), prompt_hint({"messages": turn2})
    assert len(a.prefix_blocks) >= 3 and b.prefix_blocks[: len(a.prefix_blocks)] == a.prefix_blocks
    assert b.prompt_tokens > a.prompt_tokens


@dataclass
class FakeReplica:
    """What the router reads of Serve's ``RunningReplica``."""

    replica_id: str
    routing_stats: dict = field(default_factory=dict)


@dataclass
class FakeMetadata:
    internal_request_id: str


@dataclass
class FakePending:
    args: list
    kwargs: dict = field(default_factory=dict)
    metadata: FakeMetadata | None = None


def pending(hint: PromptHint, key: str) -> FakePending:
    return FakePending([ForwardedRequest("POST", "/v1/completions", hint=hint)], metadata=FakeMetadata(key))


def _router(**kwargs) -> PrefillAwareRouter:
    router = PrefillAwareRouter(deployment_id=DeploymentID(name="model-x", app_name="swiftkv"),
                                handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**kwargs)
    return router


def test_serve_router_returns_one_replica_per_rank_without_blocking():
    router = _router(prefill_tokens_per_s=1000.0)
    replicas = [FakeReplica("r1", waiting(9000).to_metrics()), FakeReplica("r2", waiting(100).to_metrics()),
                FakeReplica("r3")]  # r3 has not reported yet: its own sends only
    request = FakePending([ForwardedRequest("POST", "/v1/completions", hint=ids_prompt(500))])
    coroutine = router.choose_replicas(replicas, request)
    with pytest.raises(StopIteration) as done:  # finishes at its first step: nothing is awaited
        coroutine.send(None)
    ranks = done.value.value
    assert [[r.replica_id for r in rank] for rank in ranks] == [["r3"], ["r2"], ["r1"]]


def test_serve_router_counts_routed_requests_and_reads_no_hint_safely():
    router = _router()
    replicas = [FakeReplica("r1", waiting(0, at=0.0).to_metrics()), FakeReplica("r2", waiting(0, at=0.0).to_metrics())]
    request = FakePending([ForwardedRequest("POST", "/v1/completions", hint=ids_prompt(3000))])
    first = asyncio.run(router.choose_replicas(replicas, request))[0][0]
    router.on_request_routed(request, first.replica_id, None)
    other = FakePending([ForwardedRequest("POST", "/v1/completions", hint=ids_prompt(3000, start=9000))])
    second = asyncio.run(router.choose_replicas(replicas, other))[0][0]
    assert second.replica_id != first.replica_id
    assert len(asyncio.run(router.choose_replicas(replicas, None))) == 2  # no request: still a ranking


def test_a_burst_ranked_before_any_is_routed_spreads_over_the_replicas():
    """Serve ranks every request of a burst before the replicas' acceptances come back (it calls
    on_request_routed a round trip later): each prompt counts against its first choice at once."""
    router = _router()
    replicas = [FakeReplica("r1", waiting(0, at=0.0).to_metrics()), FakeReplica("r2", waiting(0, at=0.0).to_metrics())]
    burst = [pending(ids_prompt(1000, start=10_000 * i), f"req-{i}") for i in range(4)]
    firsts = [asyncio.run(router.choose_replicas(replicas, p))[0][0].replica_id for p in burst]
    assert sorted(firsts) == ["r1", "r1", "r2", "r2"]
    for p, replica in zip(burst, firsts, strict=True):
        router.on_request_routed(p, replica, None)  # confirmed where chosen: nothing counts twice
    assert router.core._sent_since("r1", 0.0, router.core.clock()) == 2000
    # A request ranked again (Serve's retry after a rejection) is ranked without its own count.
    retry = pending(ids_prompt(1000, start=90_000), "req-retry")
    first = asyncio.run(router.choose_replicas(replicas, retry))[0][0].replica_id
    assert asyncio.run(router.choose_replicas(replicas, retry))[0][0].replica_id == first
    assert router.core._sent_since(first, 0.0, router.core.clock()) == 3000


def test_a_request_sent_elsewhere_than_its_first_choice_counts_once(core):
    core, _ = core
    hint = ids_prompt(700)
    core.record_sent("r1", hint, "req")  # ranked first (then full, say)
    core.withdraw("req")  # ranked again on a retry...
    core.record_sent("r1", hint, "req")  # ...first again: still counted once
    core.confirm("req", "r2", hint)  # Serve sent it to the second rank
    assert core._sent_since("r1", 0.0, core.clock()) == 0 and core._sent_since("r2", 0.0, core.clock()) == 700
    assert core.rank([("r1", waiting(0, at=0.0)), ("r2", waiting(0, at=0.0))], hint)[0] == "r2"  # its prefix


def test_router_kwargs_are_validated():
    with pytest.raises(ValueError, match="prefix_margin"):
        _router(prefix_margin=3)


def test_a_retry_ranks_the_replica_that_failed_it_last():
    router = _router()
    replicas = [FakeReplica("r1", waiting(0, at=0.0).to_metrics()),
                FakeReplica("r2", waiting(5000, at=0.0).to_metrics())]
    retry = FakePending([ForwardedRequest("POST", "/v1/completions", hint=ids_prompt(10), avoid_replicas=("r1",))],
                        metadata=FakeMetadata("req-1"))
    ranks = asyncio.run(router.choose_replicas(replicas, retry))
    assert [[r.replica_id for r in rank] for rank in ranks] == [["r2"], ["r1"]]  # r1 still a last resort
