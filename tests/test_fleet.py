"""The fleet simulator: exact answers on tiny traces, the real policy and routers in the loop,
profiles, traces and configs, and bad input."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import serve_apps.policy
import serve_apps.router
from serve_apps.fleet.config import FleetConfig, TrafficConfig
from serve_apps.fleet.profile import ModelFigures, Profile, ReplicaCosts, load_profile, save_profile
from serve_apps.fleet.results import summarize
from serve_apps.fleet.simulator import simulate
from serve_apps.fleet.synthetic import SyntheticConfig, generate
from serve_apps.fleet.trace import Trace, TraceRequest, scale_lengths, superpose, window
from serve_apps.fleet.trace_files import read_trace, write_trace

PROFILES = Path(__file__).resolve().parents[1] / "serve_apps" / "fleet" / "profiles"
TRACES = PROFILES.parent / "traces"


def figures(rate: float = 1000.0, step_s: float = 0.01, budget: int = 257, kv_tokens: int = 10**6,
            startup_s: float = 0.0) -> ModelFigures:
    """A replica with a constant prefill rate and a constant decode step: TTFTs by hand."""
    return ModelFigures(model="m", hardware="hand", prefill_tokens_per_s=rate,
                        prefill_tokens_per_s_by_input_len={1: rate}, decode_step_s_by_batch={1: step_s},
                        kv_cache_tokens=kv_tokens, max_num_batched_tokens=budget, max_num_seqs=16,
                        startup_s=startup_s)


def run(requests: list[TraceRequest], fleet: dict, block_tokens: int = 100, **figure_kwargs):
    trace = Trace(tuple(requests), block_tokens)
    cfg = FleetConfig(model="m", **fleet)
    return simulate(cfg, trace, Profile(models={"m": figures(**figure_kwargs)}))


def blocks(start: int, count: int) -> tuple[int, ...]:
    return tuple(range(start, start + count))


def test_one_replica_ttfts_are_exact():
    """1000 tokens at 1000 tok/s: 1 s. The second prompt is prefilled in chunks of 256 tokens beside
    one decoding sequence: three steps of 0.01 + 0.256 s, then 0.01 + 0.232 s; the first sequence's
    100 decode steps (4 of them beside that prefill) finish at 3 s."""
    a = TraceRequest(0.0, 1000, 101, blocks(0, 10))
    b = TraceRequest(1.0, 1000, 1, blocks(100, 10))
    result = run([a, b], {"static_replicas": 1})
    first, second = result.requests
    assert first.ttft_s == pytest.approx(1.0)
    assert second.ttft_s == pytest.approx(3 * 0.266 + 0.242)
    assert first.finish_s == pytest.approx(3.0)
    assert second.finish_s == second.first_token_s


def test_prompts_finishing_in_one_step_get_their_first_tokens_together():
    """The first prompt starts a step alone (0.3 s); the two queued behind it share the next step
    (0.6 s) and get their first tokens together; one arriving during that step waits for the next."""
    burst = [TraceRequest(0.0, 300, 1, blocks(10 * i, 3)) for i in range(3)] + [TraceRequest(0.5, 100, 1, (99,))]
    result = run(burst, {"static_replicas": 1}, budget=4096)
    assert [r.first_token_s for r in result.requests] == pytest.approx([0.3, 0.9, 0.9, 1.0])


def test_the_front_end_passes_a_burst_one_request_at_a_time():
    """The same burst through a front end of 0.1 s per request plus 0.05 s: the first prompt reaches
    the replica at 0.15 s and runs alone (to 0.45 s); the second (at 0.25 s) and third (at 0.35 s)
    share the next step (0.6 s, to 1.05 s); one arriving at 0.5 s, the front end free again, reaches
    it at 0.65 s and waits for that step's end. TTFTs count from arrival."""
    burst = [TraceRequest(0.0, 300, 1, blocks(10 * i, 3)) for i in range(3)] + [TraceRequest(0.5, 100, 1, (99,))]
    result = run(burst, {"static_replicas": 1, "ingress_s": 0.1, "ingress_latency_s": 0.05}, budget=4096)
    assert [r.first_token_s for r in result.requests] == pytest.approx([0.45, 1.05, 1.05, 1.15])
    assert [r.routed_s for r in result.requests] == pytest.approx([0.15, 0.25, 0.35, 0.65])
    assert result.requests[3].ttft_s == pytest.approx(0.65)


def test_a_shared_host_slows_the_steps_started_while_every_replica_is_busy():
    """Two replicas at 1000 tok/s sharing their host with the serving stack, slowdown 1.5: the first
    300-token prompt starts on an idle host (0.3 s); the second, started while the other replica is
    busy, takes 0.45 s; a lone one later 0.3 s again. Without the slowdown each takes 0.3 s. The
    validation's slowdown is the engines' cores with none idle, calibration over serving."""
    from serve_apps.fleet.validate import shared_host_slowdown

    requests = [TraceRequest(0.0, 300, 1, blocks(0, 3)), TraceRequest(0.0, 300, 1, blocks(10, 3)),
                TraceRequest(2.0, 300, 1, blocks(20, 3))]
    slowed = run(requests, {"static_replicas": 2, "shared_host_slowdown": 1.5}, budget=4096)
    assert sorted(r.replica for r in slowed.requests[:2]) == [0, 1]
    assert [r.ttft_s for r in slowed.requests] == pytest.approx([0.3, 0.45, 0.3])
    assert [r.ttft_s for r in run(requests, {"static_replicas": 2}, budget=4096).requests] == pytest.approx([0.3] * 3)
    calibration = {"saturated_periods": 60, "engines_when_saturated": 1.93}
    assert shared_host_slowdown(calibration, {"saturated_periods": 12, "engines_when_saturated": 1.72}) \
        == pytest.approx(1.93 / 1.72)
    assert shared_host_slowdown(calibration, {"saturated_periods": 12, "engines_when_saturated": 1.95}) == 1.0
    assert shared_host_slowdown(calibration, {"saturated_periods": 0}) == 1.0
    assert shared_host_slowdown({}, {"saturated_periods": 12, "engines_when_saturated": 1.72}) == 1.0


def test_simultaneous_arrivals_in_another_order_change_the_percentiles_by_hand():
    """A 900-token and a 100-token prompt 10 ms apart, a lone 100-token one at 2 s; one replica at
    1000 tok/s, 500 tokens a step. 900 first: 500 of it to 0.5 s, then 400 + 100 to 0.9 s, TTFTs
    1.0 / 0.99 / 0.1 (p50 0.99, p90 1.0). 100 first: it alone to 0.1 s, the 900 in two steps to 1.0 s,
    TTFTs 0.1 / 0.99 / 0.1 (p50 0.1, p90 0.99). Shuffling keeps every request and the arrival times
    and groups only arrivals within ``tie_s``."""
    from serve_apps.fleet.trace import shuffle_simultaneous
    from serve_apps.fleet.validate import order_runs, order_spread

    trace = Trace((TraceRequest(0.0, 900, 1, blocks(0, 9)), TraceRequest(0.01, 100, 1, (50,)),
                   TraceRequest(2.0, 100, 1, (60,))), 100)
    orders = {tuple(r.input_tokens for r in shuffle_simultaneous(trace, 0.05, seed).requests) for seed in range(20)}
    assert orders == {(900, 100, 100), (100, 900, 100)}
    assert [r.arrival_s for r in shuffle_simultaneous(trace, 0.05, 3).requests] == [0.0, 0.01, 2.0]
    assert shuffle_simultaneous(trace, 0.0, 3) == trace  # 10 ms apart: not simultaneous at 0
    fleet = FleetConfig(model="m", static_replicas=1)
    profile = Profile(models={"m": figures(budget=500)})
    spread = order_spread(order_runs(fleet, trace, profile, 20, 0.05))
    assert spread["ttft_p50_s"]["min"] == pytest.approx(0.1) and spread["ttft_p50_s"]["max"] == pytest.approx(0.99)
    assert spread["ttft_p90_s"]["min"] == pytest.approx(0.99) and spread["ttft_p90_s"]["max"] == pytest.approx(1.0)
    assert order_spread(order_runs(fleet, trace, profile, 0, 0.05)) == {}


def test_queued_prompts_wait_their_turn_and_a_cached_prefix_is_not_recomputed():
    a = TraceRequest(0.0, 1000, 1, blocks(0, 10))
    b = TraceRequest(0.5, 500, 1, blocks(50, 5))  # arrives while the first prefills: waits 0.5 s
    c = TraceRequest(5.0, 1200, 1, blocks(0, 12))  # its first 10 blocks are cached: 200 tokens to compute
    result = run([a, b, c], {"static_replicas": 1}, budget=4096)
    assert [r.ttft_s for r in result.requests] == pytest.approx([1.0, 1.0, 0.2])
    assert [r.uncached_tokens for r in result.requests] == [1000, 500, 200]


def test_kv_capacity_holds_requests_back_and_lru_evicts():
    # Room for 12 blocks of 100 tokens: the second request (10 blocks + output room) waits for the first.
    a = TraceRequest(0.0, 1000, 101, blocks(0, 10))
    b = TraceRequest(0.0, 1000, 1, blocks(20, 10))
    result = run([a, b], {"static_replicas": 1}, kv_tokens=1200, budget=4096)
    first, second = result.requests
    assert second.first_token_s == pytest.approx(first.finish_s + 1.0)
    again = run([a, b, TraceRequest(10.0, 1000, 1, blocks(0, 10))], {"static_replicas": 1}, kv_tokens=1200,
                budget=4096)
    assert again.requests[2].uncached_tokens == 1000  # the first prompt's blocks were evicted for the second's


def test_a_full_cache_preempts_the_newest_request_which_recomputes_later():
    """KV for 1,200 tokens. Two 300-token prompts with 500-token replies both fit when admitted; their
    replies outgrow the cache at step 300 (600 prompt + 599 generated tokens held): the newer one is
    preempted after 299 tokens, waits for the other to finish (5.59 s), then recomputes 300 tokens
    (its prompt's blocks were still cached: its last prompt token and the 299 it had produced), 0.3 s,
    and decodes its last 200 tokens."""
    a = TraceRequest(0.0, 300, 500, blocks(0, 3))
    b = TraceRequest(0.0, 300, 500, blocks(10, 3))
    first, second = run([a, b], {"static_replicas": 1}, kv_tokens=1200, budget=4096).requests
    assert (first.preemptions, second.preemptions) == (0, 1) and second.recomputed_tokens == 300
    assert second.first_token_s == pytest.approx(0.61) and first.finish_s == pytest.approx(5.59)
    assert second.finish_s == pytest.approx(5.59 + 0.3 + 2.0)
    # With room for both, nothing is preempted and both finish together.
    roomy = run([a, b], {"static_replicas": 1}, kv_tokens=1700, budget=4096).requests
    assert [r.preemptions for r in roomy] == [0, 0] and roomy[1].finish_s == pytest.approx(0.61 + 4.99)


def test_serve_delays_run_on_the_simulated_clock():
    """A burst needs more replicas; Serve's upscale delay (wall clock in Serve) holds on simulated time."""
    burst = [TraceRequest(0.1 * i, 2000, 1, blocks(100 * i, 20)) for i in range(200)]
    result = run(burst, {"autoscaling": {"min_replicas": 1, "max_replicas": 8, "upscale_delay_s": 7.0,
                                         "ttft_budget_s": 2.0}}, startup_s=5.0)
    ups = [t for t, old, new in result.scale_events if new > old]
    assert ups and ups[0] >= 7.0
    assert summarize(result, 2.0)["peak_replicas"] > 1


def _light_load() -> list[TraceRequest]:
    return [TraceRequest(float(i), 200, 1, blocks(10 * i, 2)) for i in range(60)]


def test_the_real_policy_decides(monkeypatch):
    fleet = {"autoscaling": {"min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 0.0}}
    assert run(_light_load(), fleet).scale_events == []  # 200 tok/s against 1000: one replica holds
    calls = []

    def always_more(loads, current, cfg, *request_counts):
        calls.append(current)
        return serve_apps.policy.Decision(current + 1, "more")

    monkeypatch.setattr(serve_apps.policy, "decide", always_more)
    result = run(_light_load(), fleet)
    assert calls and [new for _, _, new in result.scale_events][:3] == [2, 3, 4]


def test_serves_request_count_policy_is_the_baseline(monkeypatch):
    fleet = {"autoscaling": {"min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 0.0, "policy": "requests",
                             "target_ongoing_requests": 0.5}}
    busy = [TraceRequest(0.5 * i, 200, 50, blocks(10 * i, 2)) for i in range(60)]
    assert run(busy, fleet).scale_events  # about one ongoing request against a target of 0.5
    monkeypatch.setattr(serve_apps.policy, "decide", lambda *a: pytest.fail("our policy must not run"))
    run(busy, fleet)


def _two_replicas(router: str, requests: list[TraceRequest]):
    return run(requests, {"static_replicas": 2, "routing": {"router": router}})


def _placement(result) -> list[int]:
    return [r.replica for r in result.requests]


def test_the_real_router_places_requests(monkeypatch):
    requests = [TraceRequest(0.0, 3000, 1, blocks(0, 30)), TraceRequest(0.1, 100, 1, blocks(100, 1))]
    assert sorted(_placement(_two_replicas("prefill", requests))) == [0, 1]  # the short prompt skips the queue
    monkeypatch.setattr(serve_apps.router.PrefillRouterCore, "rank",
                        lambda self, replicas, hint: sorted((r for r, _ in replicas), key=lambda r: r.unique_id))
    assert _placement(_two_replicas("prefill", requests)) == [0, 0]


def test_the_router_keeps_a_prefix_where_it_is_cached():
    first = TraceRequest(0.0, 1000, 1, blocks(0, 10))
    others = [TraceRequest(5.0 + i, 1000 + 100 * i, 1, blocks(0, 10) + blocks(1000 + 10 * i, 1 + i))
              for i in range(4)]
    result = _two_replicas("prefill", [first, *others])
    assert len(set(_placement(result))) == 1 and all(r.uncached_tokens <= 500 for r in result.requests[1:])


def test_the_router_spreads_decoding_requests_when_no_prefill_waits():
    """Short prompts, long replies: no replica has prefill waiting when a request comes, so the prefill
    estimates tie; the emptier replica wins the tie and the requests spread (ranked on prefill alone,
    most went to one replica)."""
    requests = [TraceRequest(2.0 * i, 100, 500, blocks(10 * i, 1)) for i in range(24)]
    result = run(requests, {"static_replicas": 4, "routing": {"router": "prefill"}})
    placed = [_placement(result).count(n) for n in range(4)]
    assert max(placed) <= 7, placed


def test_serves_power_of_two_router_is_the_baseline(monkeypatch):
    from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

    requests = [TraceRequest(0.01 * i, 500, 20, blocks(10 * i, 5)) for i in range(20)]
    assert len(set(_placement(_two_replicas("pow2", requests)))) == 2

    async def first_only(self, candidate_replicas, pending_request=None):
        return [[min(candidate_replicas, key=lambda r: r.replica_id.unique_id)]]

    monkeypatch.setattr(PowerOfTwoChoicesRequestRouter, "choose_replicas", first_only)
    monkeypatch.setattr(serve_apps.router.PrefillRouterCore, "rank", lambda *a: pytest.fail("ours must not run"))
    assert set(_placement(_two_replicas("pow2", requests))) == {0}


def test_a_power_of_two_run_places_every_request_alike_in_every_process():
    # Serve's router draws its two candidates by position in a set of replica ids: with the string
    # hash (seeded per process) one config and seed gave other placements, and other report figures,
    # in each process.
    script = (
        "import json, sys; sys.path.insert(0, 'tests'); from test_fleet import TraceRequest, blocks, run, _placement\n"
        "requests = [TraceRequest(0.01 * i, 500, 20, blocks(10 * i, 5)) for i in range(60)]\n"
        "print(json.dumps(_placement(run(requests, {'static_replicas': 5, 'routing': {'router': 'pow2'}}))))")
    root = Path(__file__).resolve().parents[1]
    placements = [subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=True,
                                 env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout.strip().splitlines()[-1]
                  for seed in (1, 2, 3)]
    assert len(set(json.loads(placements[0]))) == 5  # spread over every replica
    assert placements[1:] == placements[:1] * 2


def test_serves_queue_length_probes_answer_in_the_candidates_order():
    # Serve collects the answers from asyncio's ``done`` set (task-address order) and keeps the first
    # of two equally loaded candidates: unordered, a power-of-two run placed requests differently
    # from one run to the next.
    from serve_apps.config import ModelOptions
    from serve_apps.fleet.serve_control import Router, SimReplicaHandle

    async def probe_in_shuffled_orders():
        options = ModelOptions(name="fleet", model="m", prefill_tokens_per_s=1000.0, routing={"router": "pow2"})
        router = Router(options, clock=lambda: 0.0)
        handles = [SimReplicaHandle(SimpleNamespace(number=n, ongoing=n % 2), 4) for n in range(8)]
        router.update_replicas(handles)
        orders = [random.Random(seed).sample(handles, len(handles)) for seed in range(5)]
        answers = [await router.router._probe_queue_lens(order, 0) for order in orders]
        return orders, answers

    orders, answers = asyncio.run(probe_in_shuffled_orders())
    assert [[handle for handle, _ in answer] for answer in answers] == orders
    assert all(length == handle.replica.ongoing for answer in answers for handle, length in answer)


def test_max_ongoing_requests_holds_requests_at_the_router():
    requests = [TraceRequest(0.0, 100, 200, blocks(10 * i, 1)) for i in range(3)]
    result = run(requests, {"static_replicas": 1, "max_ongoing_requests": 2}, budget=4096)
    third = result.requests[2]
    assert third.routed_s == pytest.approx(min(r.finish_s for r in result.requests[:2]))


def test_requests_queued_at_the_router_reach_the_policy():
    """Short prompts with long replies: prefill load is light, but every replica is full and requests
    wait at the handle. Serve hands the policy that queue (``total_queued_requests``): it scales up."""
    requests = [TraceRequest(0.05 * i, 50, 400, blocks(10 * i, 1)) for i in range(12)]
    fleet = {"max_ongoing_requests": 2, "autoscaling": {"min_replicas": 1, "max_replicas": 6, "upscale_delay_s": 0.0}}
    result = run(requests, fleet, budget=4096)
    assert result.scale_events and max(new for _, _, new in result.scale_events) >= 3


def test_costs_interpolate_and_fit_decode():
    f = ModelFigures(model="m", hardware="h", prefill_tokens_per_s=500, prefill_tokens_per_s_by_input_len={
        1000: 1000, 3000: 500}, decode_step_s_by_batch={1: 0.0111, 9: 0.0199}, decode_context_tokens=100,
        decode_step_s_by_context={100: 0.0199, 1100: 0.0289}, decode_context_batch=9, kv_cache_tokens=1,
        max_num_batched_tokens=1, max_num_seqs=1, startup_s=0)
    costs = ReplicaCosts.from_figures(f)
    assert [costs.prefill_rate(n) for n in (10, 2000, 9000)] == pytest.approx([1000, 750, 500])
    # step = 0.01 + 0.001 * batch + 1e-6 * context tokens: exactly the points above
    assert costs.decode_step_s(4, 4000) == pytest.approx(0.01 + 0.004 + 0.004)
    assert costs.decode_step_s(0, 0) == 0


@pytest.mark.parametrize("name", sorted(p.name for p in PROFILES.glob("*.json")))
def test_committed_profiles_round_trip(name, tmp_path):
    """The committed profiles (the CPU one as `swiftkv calibrate` wrote it) read, write and read back equal,
    and every variant gives costs."""
    profile = load_profile(PROFILES / name)
    save_profile(profile, tmp_path / "again.json")
    assert load_profile(tmp_path / "again.json") == profile
    for figures_ in profile.models.values():
        costs = ReplicaCosts.from_figures(figures_)
        assert costs.prefill_rate(1000) > 0 and costs.decode_step_s(8, 8000) > 0


def test_calibration_output_is_a_profile(tmp_path):
    from serve_apps.calibrate import format_profile

    profile = load_profile(PROFILES / "cpu-smollm2.json")
    raw = json.loads((PROFILES / "cpu-smollm2.json").read_text())
    assert "prefill_tokens_per_s: " in format_profile(raw)  # calibrate's own printer reads the same file
    assert set(raw["models"]) == set(profile.models) == {"base", "swiftkv-50", "swiftkv-50-acrosskv"}


def test_a_profile_measured_through_serve_keeps_the_engine_limits_and_round_trips(tmp_path):
    from serve_apps.fleet.serve_profile import serve_figures
    from serve_apps.fleet.validate import ValidateConfig

    engine = load_profile(PROFILES / "cpu-smollm2.json").figures("swiftkv-50")
    cfg = ValidateConfig(traffic=TrafficConfig(trace="unused.jsonl"), profile="unused.json", replicas=2,
                         calibration={"input_lens": [32, 1536], "batches": [1, 8], "decode_contexts": [1024]})
    curves = {"prefill_tokens_per_s_by_input_len": {32: 120.0, 1536: 300.0}, "decode_step_s_by_batch": {1: 0.1, 8: 0.2},
              "decode_step_s_by_context": {1024: 0.3}, "decode_context_batch": 8}
    figures = serve_figures(engine, curves, cfg)
    assert figures.prefill_tokens_per_s == 300.0 and figures.decode_step_s_by_batch == {1: 0.1, 8: 0.2}
    assert figures.decode_step_s_by_context == {1024: 0.3} and figures.decode_context_batch == 8
    assert (figures.kv_cache_tokens, figures.max_num_batched_tokens, figures.startup_s) == (
        engine.kv_cache_tokens, engine.max_num_batched_tokens, engine.startup_s)
    assert figures.side_by_side == 2 and "through swiftkv serve" in figures.notes
    save_profile(Profile(models={"swiftkv-50": figures}), tmp_path / "serve.json")
    assert load_profile(tmp_path / "serve.json").figures("swiftkv-50") == figures


def test_traces_read_write_window_superpose_and_scale(tmp_path):
    trace = Trace((TraceRequest(0.0, 1000, 5, (0, 1)), TraceRequest(2.0, 600, 3, (0, 2)),
                   TraceRequest(4.0, 300, 1, (3,))), 512)
    write_trace(trace, tmp_path / "t.jsonl")
    assert read_trace(tmp_path / "t.jsonl") == trace
    assert [r.arrival_s for r in window(trace, 1.0, 2.0).requests] == [1.0]
    doubled = superpose(trace, 2)
    assert len(doubled.requests) == 6 and sorted(r.arrival_s for r in doubled.requests) == [0, 0, 2, 2, 2, 4]
    ids = [set(b for r in doubled.requests if r.input_tokens == n for b in r.blocks) for n in (1000, 600)]
    assert ids == [{0, 1, 4, 5}, {0, 2, 4, 6}]  # each copy its own ids, shared prefixes kept within a copy
    small = scale_lengths(trace, 64, 100, 2)
    assert [(r.input_tokens, r.output_tokens, r.blocks) for r in small.requests] == [(64, 2, (0,)), (64, 2, (0,)),
                                                                                     (38, 1, (3,))]


def test_synthetic_traffic_is_poisson_and_conversations_share_prefixes():
    cfg = SyntheticConfig(duration_s=2000, rate=2.0, followup_share=0.5, block_tokens=100, seed=3)
    trace = generate(cfg)
    assert trace == generate(cfg)
    assert len(trace.requests) / cfg.duration_s == pytest.approx(2.0, rel=0.1)
    firsts = {r.blocks[0] for r in trace.requests if r.blocks}
    assert len(firsts) < 0.7 * len(trace.requests)  # follow-ups start with an earlier turn's blocks
    ramp = generate(cfg.model_copy(update={"rate_schedule": [(1000.0, 0.0)]}))
    assert max(r.arrival_s for r in ramp.requests) < 1000


def test_the_shipped_traces_read_and_scale():
    """The three traces in the repository: Mooncake's hour (its first minute is the validation's
    slice) and Azure's two CSVs, read by one loader (wall-clock arrivals from 0, no prefix blocks)."""
    first_minute = TrafficConfig(trace=str(TRACES / "mooncake_conversation_trace.jsonl"), duration_s=60).build()
    assert len(first_minute.requests) == 162 and first_minute.block_tokens == 512
    built = TrafficConfig(trace=str(TRACES / "mooncake_conversation_trace.jsonl"), duration_s=60, copies=2,
                          time_factor=3.0,
                          lengths={"block_tokens": 16, "max_input_tokens": 1536, "max_output_tokens": 16}).build()
    assert len(built.requests) == 324 and built.duration_s < 180 and built.block_tokens == 16
    assert max(r.input_tokens for r in built.requests) == 1536 and max(r.output_tokens for r in built.requests) == 16
    for name, count, span_min in (("conv", 19366, 58), ("code", 8819, 57)):
        trace = read_trace(TRACES / "azure-llm-2023" / f"AzureLLMInferenceTrace_{name}.csv")
        assert len(trace.requests) == count and int(trace.duration_s // 60) == span_min
        assert trace.requests[0].arrival_s == 0.0 and not any(r.blocks for r in trace.requests)
    code = read_trace(TRACES / "azure-llm-2023" / "AzureLLMInferenceTrace_code.csv").requests[:2]
    assert [(r.input_tokens, r.output_tokens) for r in code] == [(4808, 10), (3180, 8)]
    assert code[1].arrival_s == pytest.approx(0.052)  # 18:17:04.0319600 - 18:17:03.9799600


def test_bad_input_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 5,\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON object"):
        read_trace(bad)
    bad.write_text('{"timestamp": 0, "input_length": -3, "output_length": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: 'input_length' must be an integer of at least 1"):
        read_trace(bad)
    bad.write_text('{"timestamp": 900, "input_length": 10, "output_length": 1}\n'
                   '{"timestamp": 800, "input_length": 10, "output_length": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: 'timestamp' goes backwards"):
        read_trace(bad)
    neither = tmp_path / "neither.txt"
    neither.write_text("time,prompt,output\n0,10,1\n")
    with pytest.raises(ValueError, match=r"neither.txt:1: neither a Mooncake trace .* nor an Azure trace"):
        read_trace(neither)
    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,10\n")
    with pytest.raises(ValueError, match=r"azure.csv:1: missing column 'GeneratedTokens'"):
        read_trace(csv)
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,1\n"
                   "2023-11-16 18:15:47.00,10,x\n")
    with pytest.raises(ValueError, match=r"azure.csv:3: 'GeneratedTokens' must be an integer, got 'x'"):
        read_trace(csv)
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,1\n"
                   "2023-11-16 18:15:45.00,10,1\n")
    with pytest.raises(ValueError, match=r"azure.csv:3: 'TIMESTAMP' goes backwards"):
        read_trace(csv)
    with pytest.raises(FileNotFoundError, match="trace file not found"):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="the profile has no model 'large'"):
        Profile(models={"m": figures()}).figures("large")
    with pytest.raises(ValueError, match="exactly one of trace"):
        TrafficConfig()


@pytest.mark.parametrize("path", sorted((PROFILES.parent / "configs").glob("validate-*.yaml")), ids=lambda p: p.name)
def test_the_shipped_validation_configs_read_and_name_their_fleet(path):
    from serve_apps.fleet.validate import ValidateConfig, validation_fleet
    from swiftkv.yaml_config import load_config

    cfg = load_config(ValidateConfig, path)
    fleet = validation_fleet(cfg)
    assert (fleet.static_replicas is None) == (cfg.autoscaling is not None)
    assert fleet.routing.router == cfg.fleet.routing.router and cfg.traffic.build().requests


@pytest.mark.parametrize("path", sorted((PROFILES.parent / "configs").glob("report-*.yaml")), ids=lambda p: p.name)
def test_the_shipped_report_configs_read_and_their_runs_exist(path):
    """On each shipped config, what `swiftkv fleet report --config` checks before its first run (the
    keys, the profile's variants, the traffic: the trace in the repository), and that the runs it
    plots are among its own (the report skips a plotted run it does not make: `--set
    variants=[base]` fills a shared cache with a part of the grid)."""
    from serve_apps.fleet.report import ReportConfig
    from swiftkv.yaml_config import load_config

    cfg = load_config(ReportConfig, path)
    profile = load_profile(cfg.profile)
    for variant in cfg.variants:
        profile.figures(variant)
    assert cfg.traffic.build().requests
    assert set(cfg.main) <= {f"{v}/{f.policy}/{f.router}" for v in cfg.variants for f in cfg.fleets}


def test_a_validation_without_measure_needs_a_profile():
    from serve_apps.fleet.validate import ValidateConfig, simulation_inputs

    cfg = ValidateConfig(traffic=TrafficConfig(trace="unused.jsonl"), measure=None)
    with pytest.raises(ValueError, match="needs `profile` when `measure` is null"):
        simulation_inputs(cfg)
    given = ValidateConfig(traffic=TrafficConfig(trace="unused.jsonl"), measure=None,
                           profile=str(PROFILES / "cpu-smollm2.json"))
    assert simulation_inputs(given) == load_profile(PROFILES / "cpu-smollm2.json")


def test_each_replay_pass_has_its_own_token_ids_with_the_traces_sharing():
    """A salted pass keeps which prompts share which blocks and shares no block with another pass or
    the warm-up (so no pass finds another's prefix cache); its ids stay in the prompt vocabulary."""
    from serve_apps.fleet.replay import FIRST_TOKEN_ID, PASS_SALT, PROMPT_VOCAB, WARMUP_SALT, prompt_ids, salted

    trace = Trace((TraceRequest(0.0, 48, 1, (1, 2, 3)), TraceRequest(1.0, 40, 1, (1, 2, 4))), 16)
    base = [prompt_ids(r, i, 16, PROMPT_VOCAB) for i, r in enumerate(trace.requests)]
    assert base[0][:32] == base[1][:32] and base[0][32:40] != base[1][32:40]
    passes = {salt: [salted(p, salt, PROMPT_VOCAB) for p in base]
              for salt in [WARMUP_SALT, *(k * PASS_SALT for k in range(10))]}
    assert passes[0] == base
    blocks_by_salt = {}
    for salt, prompts in passes.items():
        assert prompts[0][:32] == prompts[1][:32] and [len(p) for p in prompts] == [48, 40]
        assert all(FIRST_TOKEN_ID <= t < PROMPT_VOCAB for p in prompts for t in p)
        blocks_by_salt[salt] = {tuple(p[i:i + 16]) for p in prompts for i in range(0, len(p), 16)}
    every = [b for blocks in blocks_by_salt.values() for b in blocks]
    assert len(every) == len(set(every)) == 11 * 4


def test_repeated_passes_are_pooled_by_hand():
    """Two passes: TTFTs pooled before the percentiles (nearest rank over 0.1..0.6: p50 0.3, p90 0.6;
    the passes' own are 0.3 / 0.5 and 0.4 / 0.6), throughput over the sum of the passes' spans (the
    pause between them left out): 12 tokens over 2.5 + 3.5 s."""
    from serve_apps.fleet.validate import pooled_figures

    def record(sent, ttft, latency, tokens=2):
        return {"sent_s": sent, "ttft_s": ttft, "latency_s": latency, "output_tokens": tokens}

    first = [record(0.0, 0.1, 1.0), record(1.0, 0.3, 1.5), record(1.5, 0.5, 0.5)]
    second = [record(0.0, 0.2, 1.0), record(2.0, 0.4, 1.5), record(2.5, 0.6, 0.5)]
    pooled = pooled_figures([first, second])
    assert pooled["requests"] == 6 and pooled["failed"] == 0
    assert (pooled["ttft_p50_s"], pooled["ttft_p90_s"]) == (0.3, 0.6)
    assert pooled["output_tokens_per_s"] == pytest.approx(12 / 6)
    second[2] = record(2.5, None, None, None)  # a failed request: counted, not timed, its span not extended
    pooled = pooled_figures([first, second])
    assert pooled["failed"] == 1 and pooled["output_tokens_per_s"] == pytest.approx(10 / 6)


def test_a_saved_validation_is_simulated_again_by_hand(tmp_path, capsys):
    """`swiftkv fleet resimulate` on a hand-made validation folder: the slice of the order test above
    (simulated in the trace's order: TTFTs 1.0 / 0.99 / 0.1), two measured passes (1.1 / 1.0 / 0.2 and
    0.9 / 1.2 / 0.1, pooled p50 0.9 and p90 1.2), no random orders: ratios 1.1 and 0.83, and each
    measured request beside its simulated TTFT. With random orders the simulated figures pool them
    with the trace's order (p50 0.1 or 0.99), and the trace's order alone is kept beside them."""
    from serve_apps.fleet.profile import profile_json
    from serve_apps.fleet.validate import ValidateConfig, resimulate
    from swiftkv.cli import main

    write_trace(Trace((TraceRequest(0.0, 900, 1, blocks(0, 2)), TraceRequest(0.01, 100, 1, (50,)),
                       TraceRequest(2.0, 100, 1, (60,))), 512), tmp_path / "slice.jsonl")
    (tmp_path / "profile.json").write_text(profile_json(Profile(models={"m": figures(budget=500)})))
    cfg = ValidateConfig(traffic=TrafficConfig(trace=str(tmp_path / "slice.jsonl")), measure=None, model="m",
                         replicas=1, arrival_orders=0, tie_s=0.05)

    def record(k, sent, ttft):
        return {"sent_s": sent, "ttft_s": ttft, "latency_s": ttft + 0.01, "output_tokens": 1, "error": "",
                "pass": k, "pass_start_s": 10.0 * k, "simulated_ttft_s": 123.0}  # the last is dropped

    saved = {"config": cfg.model_dump(mode="json"), "requests": 3, "front_end": {"ingress_s": 0.0,
             "ingress_latency_s": 0.0}, "shared_host_slowdown": 1.0, "per_request": [
             record(0, 0.0, 1.1), record(0, 0.01, 1.0), record(0, 2.0, 0.2),
             record(1, 0.0, 0.9), record(1, 0.01, 1.2), record(1, 2.0, 0.1)]}
    (tmp_path / "validation.json").write_text(json.dumps(saved))
    result = resimulate(str(tmp_path))
    assert (result["measured"]["ttft_p50_s"], result["measured"]["ttft_p90_s"]) == (0.9, 1.2)
    assert result["simulated"]["ttft_p50_s"] == pytest.approx(0.99) and result["simulated"]["ttft_p90_s"] == 1.0
    assert result["simulated_over_measured"]["ttft_p50_s"] == pytest.approx(1.1)
    assert [(m["pass"], m["ttft_s"]) for m in result["per_request"]] == [
        (0, 1.1), (0, 1.0), (0, 0.2), (1, 0.9), (1, 1.2), (1, 0.1)]
    assert [m["simulated_ttft_s"] for m in result["per_request"]] == pytest.approx([1.0, 0.99, 0.1] * 2)
    saved["config"]["arrival_orders"] = 20
    (tmp_path / "validation.json").write_text(json.dumps(saved))
    assert main(["fleet", "resimulate", "--from", str(tmp_path), "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "resimulation.json").read_text())
    assert again["simulated"]["ttft_p50_s"] in (pytest.approx(0.1), pytest.approx(0.99))
    assert again["simulated_in_trace_order"]["ttft_p50_s"] == pytest.approx(0.99)
    assert "simulated: pooled over the trace's order and 20 random orders" in capsys.readouterr().out
    # A validation saved before the front end and slowdown were measured: one line naming what it lacks.
    del saved["front_end"], saved["shared_host_slowdown"]
    (tmp_path / "validation.json").write_text(json.dumps(saved))
    assert main(["fleet", "resimulate", "--from", str(tmp_path)]) == 2
    assert "has no front_end, shared_host_slowdown" in capsys.readouterr().err


def test_replica_counts_say_when_a_fleet_grew_shrank_and_how_long_a_start_took():
    from serve_apps.fleet.replica_watch import ReplicaSample, replica_figures, startup_times

    samples = [ReplicaSample(0, 1, 0), ReplicaSample(3, 1, 1), ReplicaSample(4, 1, 2), ReplicaSample(9, 2, 1),
               ReplicaSample(12, 3, 0), ReplicaSample(20, 1, 0)]
    assert startup_times(samples) == [6.0, 8.0]  # asked at 3 and 4, serving at 9 and 12
    # 1 replica for 7 s, 2 for 31 s, then 1 until the 58 s horizon: 89 replica-seconds.
    assert replica_figures([(0.0, 1), (7.0, 2), (38.0, 1), (70.0, 1)], 58.0) == {
        "replica_seconds": 89.0, "peak": 2, "peak_at_s": 7.0, "back_down_at_s": 38.0}
    assert replica_figures([(0.0, 1)], 10.0)["back_down_at_s"] is None


def test_the_warm_ups_replica_start_ups_are_left_out_of_the_shared_host_slowdown(monkeypatch):
    """An autoscaled warm-up that grew the fleet: while the second replica started (Serve saw it
    starting at 3-5 s) the serving engine had half the cores; the slowdown is taken from the other
    periods, where the engines had what they have in a fleet of serving replicas."""
    from serve_apps.fleet.host_load import HostLoad, HostSample
    from serve_apps.fleet.replica_watch import ReplicaSample, ReplicaWatch
    from serve_apps.fleet.validate import shared_host_slowdown

    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    watch = ReplicaWatch("127.0.0.1:6379", "app", "deployment")
    watch.started = 1000.0
    watch.samples = [ReplicaSample(t, 1 + (t >= 6), int(3 <= t < 6)) for t in range(10)]
    assert watch.starting_unix() == [(1002.0, 1006.0)]
    host = HostLoad(period_s=1.0)
    host.started = 1000.0
    host.samples = [HostSample(t=t, ours=2.0, engines=1.0 if 2 < t < 7 else 1.8, others=0.0, steal=0.0, idle=0.0)
                    for t in range(1, 10)]  # one period ending at each second
    calibration = {"saturated_periods": 5, "engines_when_saturated": 1.9}
    assert shared_host_slowdown(calibration, host.summary()) == pytest.approx(1.9 / ((5 * 1.8 + 4 * 1.0) / 9))
    kept = host.summary(excluding_unix=watch.starting_unix())  # the periods ending at 3..6 s overlap 2-6 s
    assert kept["saturated_periods"] == 5 and shared_host_slowdown(calibration, kept) == pytest.approx(1.9 / 1.8)
    assert host.summary(excluding_unix=[(1000.0, 1010.0)]) == {}


def test_watching_the_endpoints_replicas_without_the_loopback_setting_is_one_clear_error(monkeypatch):
    """Called from Python without ``loopback_ray``, the watch would wait minutes for an attach that
    cannot succeed; it refuses at once, naming the setting."""
    from serve_apps.fleet.replica_watch import ReplicaWatch

    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    with pytest.raises(RuntimeError, match="RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"):
        ReplicaWatch("127.0.0.1:6379", "app", "deployment")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    assert ReplicaWatch("127.0.0.1:6379", "app", "deployment").address == "127.0.0.1:6379"


def test_an_autoscaled_validation_compares_replicas_over_time_by_hand(tmp_path):
    """A saved validation of an autoscaled deployment simulated again: a burst the simulated fleet
    meets by growing 1 -> 2 (5 s start-ups, as measured on the endpoint) and shrinking back, against
    Serve's hand-made counts for one pass (1 replica, 2 from 7 s, 1 again from 38 s: 89 replica-seconds
    over the pass's 58 s)."""
    from serve_apps.fleet.profile import profile_json
    from serve_apps.fleet.validate import ValidateConfig, format_validation, resimulate

    burst = [TraceRequest(0.1 * i, 2000, 1, blocks(100 * i, 4)) for i in range(15)]
    write_trace(Trace(tuple(burst), 512), tmp_path / "slice.jsonl")
    (tmp_path / "profile.json").write_text(profile_json(Profile(models={"m": figures(budget=500)})))
    scaling = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0.0, "downscale_delay_s": 3.0,
               "look_back_period_s": 1.0, "metrics_interval_s": 0.5}
    cfg = ValidateConfig(traffic=TrafficConfig(trace=str(tmp_path / "slice.jsonl")), measure=None, model="m",
                         autoscaling=scaling, arrival_orders=0, scale_down_timeout_s=120)
    records = [{"sent_s": r.arrival_s, "ttft_s": 1.0, "latency_s": 1.1, "output_tokens": 1, "error": "",
                "pass": 0, "pass_start_s": 12.0} for r in burst]
    # The watch began 10 s after the host record, so the pass starts at 2 s on the watch's clock.
    samples = [[0, 1, 0], [2, 1, 0], [3, 1, 1], [9, 2, 0], [40, 1, 0], [60, 1, 0]]
    saved = {"config": cfg.model_dump(mode="json"), "requests": len(burst), "per_request": records,
             "front_end": {"ingress_s": 0.0, "ingress_latency_s": 0.0}, "shared_host_slowdown": 1.0,
             "replicas": {"samples": samples, "watch_started": 100.0, "host_started": 90.0, "startup_s": 5.0,
                          "startup_times_measured_s": [6.0]}}
    (tmp_path / "validation.json").write_text(json.dumps(saved))
    result = resimulate(str(tmp_path))
    [row] = result["replicas"]["passes"]
    assert row["horizon_s"] == 58.0
    assert row["measured"] == {"replica_seconds": 89.0, "peak": 2, "peak_at_s": 7.0, "back_down_at_s": 38.0}
    sim = row["simulated"]
    assert sim["peak"] == 2 and sim["peak_at_s"] >= 5.0  # no second replica before its start-up
    assert sim["back_down_at_s"] is not None and sim["back_down_at_s"] > sim["peak_at_s"]
    assert row["replica_seconds_ratio"] == pytest.approx(sim["replica_seconds"] / 89.0)
    assert result["replicas"]["startup_s"] == 5.0
    text = format_validation(result)
    assert "replica-seconds measured / simulated" in text and "| 1 | 89 / " in text
    assert "replica start-up measured: 6 s (simulated with 5 s)" in text
    assert "| 1 | 89 / " in text and "| 7 / " in text and "| 38 / " in text
    with pytest.raises(ValueError, match="min_replicas must be at least 1"):
        ValidateConfig(traffic=cfg.traffic, measure=None, model="m", autoscaling={"min_replicas": 0})


def test_the_cli_names_a_bad_config_key(tmp_path, capsys):
    from swiftkv.cli import main

    config = tmp_path / "sim.yaml"
    config.write_text(f"traffic: {{trace: {tmp_path / 'none.jsonl'}}}\nprofile: {PROFILES / 'cpu-smollm2.json'}\n"
                      "fleet: {model: base, static_replica: 2}\n")
    assert main(["fleet", "simulate", "--config", str(config)]) == 2
    assert "fleet.static_replica: unknown key" in capsys.readouterr().err
    config.write_text(f"traffic: {{trace: {tmp_path / 'none.jsonl'}}}\nprofile: {PROFILES / 'cpu-smollm2.json'}\n"
                      "fleet: {model: base}\n")
    assert main(["fleet", "simulate", "--config", str(config)]) == 2
    assert "trace file not found" in capsys.readouterr().err
    assert main(["fleet", "simulate", "--config", str(config), "--set", "profile=/nope.json"]) == 2
    assert "profile not found: /nope.json" in capsys.readouterr().err


def test_a_fleet_search_stops_a_failing_run_early():
    burst = [TraceRequest(0.01 * i, 2000, 1, blocks(100 * i, 20)) for i in range(300)]
    full = run(burst, {"static_replicas": 1})
    cfg = FleetConfig(model="m", static_replicas=1)
    partial = simulate(cfg, Trace(tuple(burst), 100), Profile(models={"m": figures()}), miss_budget=5)
    assert partial.stopped_early and not full.stopped_early
    assert sum(r.finish_s is not None for r in partial.requests) < sum(r.finish_s is not None for r in full.requests)


def test_simulate_and_report_write_their_figures(tmp_path, capsys, monkeypatch):
    from swiftkv.cli import main

    profile = tmp_path / "profile.json"
    save_profile(Profile(models={"base": figures(rate=2000.0), "fast": figures(rate=4000.0)}), profile)
    traffic = ("{synthetic: {duration_s: 120, rate: 3, input_tokens_mean: 800, output_tokens_mean: 20, "
               "block_tokens: 100}}")
    sim = tmp_path / "sim.yaml"
    sim.write_text(f"traffic: {traffic}\nprofile: {profile}\nfleet: {{model: base}}\nout: {tmp_path / 'sim'}\n")
    assert main(["fleet", "simulate", "--config", str(sim)]) == 0
    results = json.loads((tmp_path / "sim" / "results.json").read_text())
    assert results["summary"]["requests"] > 300 and (tmp_path / "sim" / "timeline.png").stat().st_size > 0
    report = tmp_path / "report.yaml"
    report.write_text(f"traffic: {traffic}\nprofile: {profile}\nvariants: [base, fast]\nout: {tmp_path / 'report'}\n"
                      "main: [base/static/pow2, fast/prefill/prefill]\n"
                      "tuning: {targets: [4, 16], delays: [[30, 600]]}\nfleet: {score_from_s: 30}\n")
    assert main(["fleet", "report", "--config", str(report)]) == 0
    out = capsys.readouterr().out
    assert "| fast | ours (prefill) | prefill |" in out and "| base | static x" in out
    assert "| base | Serve defaults (target 2, delays 30 / 600 s) | pow2 |" in out
    assert "| base/serve-tuned/pow2 | 16 | 30 / 600 |" in out  # the search is shown
    written = json.loads((tmp_path / "report" / "results.json").read_text())
    assert len(written["runs"]) == 10
    assert [t["target"].split(" vs ")[1].split(":")[0].split(" ")[0] for t in written["targets"]] == [
        "base/serve-defaults/pow2", "base/serve-tuned/pow2", "base/prefill/prefill", "base/static/prefill"]
    # every run's figures are kept, and a second report reads them back instead of simulating again
    assert len(list((tmp_path / "report" / "runs").glob("*.json"))) >= 10
    monkeypatch.setattr("serve_apps.fleet.grid.simulate", lambda *args, **kwargs: pytest.fail("simulated again"))
    assert main(["fleet", "report", "--config", str(report)]) == 0
    assert json.loads((tmp_path / "report" / "results.json").read_text())["runs"] == written["runs"]
    # the paper's checks need the paper's variants: refused before any run, naming the missing one
    assert main(["fleet", "report", "--config", str(report), "--set", "paper_checks=true"]) == 2
    assert "the profile has no model 'swiftkv-50'" in capsys.readouterr().err


def test_the_h100_profile_is_what_its_derivation_gives_and_is_checked_against_every_paper_figure():
    from serve_apps.fleet.paper_profile import FIG3, TABLE3, checks, derive, format_checks

    profile = derive()
    assert profile == load_profile(PROFILES / "h100-llama-3.1-8b.json")
    rows = checks(profile)
    # every figure is there: Fig. 3's twelve, Fig. 2's time saving, Table 3's seven
    assert len(rows) == sum(map(len, FIG3.values())) + 1 + sum(map(len, TABLE3.values()))
    fitted = [r for r in rows if r["fitted"]]
    assert [r["figure"].split(", ")[1] for r in fitted] == ["base"] * 4  # fitted to the base's four, the rest held out
    assert all(abs(r["error"]) < 0.1 for r in fitted)
    assert all(r["flagged"] == (not r["fitted"] and abs(r["error"]) > 0.15) for r in rows)
    table = format_checks(rows)
    assert table.count("(fitted)") == 4
    assert table.count("(over 15%)") == sum(r["flagged"] for r in rows) > 0


def test_a_decode_bandwidth_that_needs_unphysical_prefill_is_said_so(capsys):
    from serve_apps.fleet.paper_profile import derive
    from swiftkv.cli import main

    assert "not physical" in derive(0.3).source  # the 8K run then needs prefill past the bf16 peak
    assert main(["fleet", "derive-h100", "--hbm-efficiency", "1.5"]) == 2
    assert "--hbm-efficiency must lie in (0, 1], not 1.5" in capsys.readouterr().err


def test_the_validation_table_names_each_ratio_and_the_replicas_slowdown():
    from serve_apps.fleet.validate import format_validation

    figures = {"ttft_p50_s": 8.59, "ttft_p90_s": 17.1, "output_tokens_per_s": 7.21, "failed": 0}
    simulated = {"ttft_p50_s": 6.26, "ttft_p90_s": 14.9, "output_tokens_per_s": 7.26}
    result = {"requests": 162, "measured": figures, "simulated": simulated,
              "simulated_over_measured": {k: simulated[k] / figures[k] for k in simulated},
              "median_measured_over_simulated_ttft": 1.36}
    text = format_validation(result)
    assert "| TTFT p50 (s) | 8.59 | 6.26 | 0.73 |" in text and "| output tokens/s | 7.21 | 7.26 | 1.01 |" in text
    assert text.endswith("requests: 162, failed (measured): 0, median measured / simulated TTFT per request: 1.36")
    result["simulated_over_arrival_orders"] = {"ttft_p90_s": {"min": 13.2, "p5": 13.3, "median": 14.73, "p95": 16.02,
                                                              "max": 17.74}}
    assert format_validation(result).endswith(
        "\nsimulated TTFT p90 over random orders of simultaneous arrivals: 13.20 / 13.30 / 14.73 / 16.02 / 17.74 s "
        "(min / 5% / median / 95% / max); measured 17.10 s")
    result["host_load"] = {"summary": {
        "ours": 1.5, "engines": 1.25, "others": 0.25, "steal": 0.05, "idle": 0.2,
        "others_plus_steal_worst_10_s": 0.9, "saturated_periods": 40, "ours_when_saturated": 1.9,
        "engines_when_saturated": 1.6, "others_when_saturated": 0.05, "steal_when_saturated": 0.05}}
    assert format_validation(result).endswith(
        "host CPUs during the replay (mean cores): this run 1.50 (engines 1.25), other processes 0.25, steal 0.05, "
        "idle 0.20; others + steal in the worst 10 s: 0.90; in the 40 periods with no core idle: engines 1.60, "
        "rest of this run 0.30, others + steal 0.10")
    result["calibration_host_load"] = {**result["host_load"]["summary"], "saturated_periods": 30,
                                       "engines_when_saturated": 1.85}
    result["warmup_host_load"] = {**result["host_load"]["summary"], "saturated_periods": 12,
                                  "engines_when_saturated": 1.65}
    result["shared_host_slowdown"] = 1.85 / 1.65
    assert "\nduring the warm-up, in the 12 periods with no core idle: engines 1.65, rest of this run 0.25\n" \
        "simulated steps started while every replica is busy: x1.12 (the engines' cores with none idle, calibration " \
        "over warm-up)\n" in format_validation(result)
    assert format_validation(result).endswith(
        "\nduring the engine calibration's timed part (mean cores): engines 1.25, rest of this run 0.25, others + "
        "steal 0.30, idle 0.20; in the 30 periods with no core idle: engines 1.85")
    result["measured_per_pass"] = [{"ttft_p50_s": 8.0, "ttft_p90_s": 16.0, "output_tokens_per_s": 7.2, "failed": 0},
                                   {"ttft_p50_s": None, "ttft_p90_s": None, "output_tokens_per_s": 0.0, "failed": 3}]
    assert "per request: 1.36\nmeasured: the 2 passes below pooled\npass 1: TTFT p50 8.00 s, p90 16.00 s, 7.20 " \
        "output tokens/s, 0 failed\npass 2: TTFT p50 nan s, p90 nan s, 0.00 output tokens/s, 3 failed\nsimulated " \
        "TTFT p90" in format_validation(result)


def test_host_load_tells_this_runs_processes_from_the_hosts_others():
    """A child process that spins for 2 s counts as this run's (and, titled as vLLM's engine core
    process, as an engine); one started the same way but left to the init process (its shell exits at
    once) counts as another process's. Either takes one core, in the summary of the periods it ran
    (the window the validation takes the engine calibration's timed part by). The figure draws them."""
    import subprocess
    import sys
    import time

    from serve_apps.fleet.host_load import HostLoad
    from serve_apps.fleet.plots import validation_png

    spin = "import time\nt = time.time()\nwhile time.time() - t < 2: pass"
    with HostLoad(period_s=0.25) as host:
        time.sleep(0.3)
        subprocess.run([sys.executable, "-c", spin, "VLLM::EngineCore"], check=True)  # titled as vLLM's
        ours_until = time.time()
        subprocess.run(["sh", "-c", f"{sys.executable} -c '{spin}' >/dev/null 2>&1 &"], check=True)
        time.sleep(2.6)
    child = host.summary((ours_until - 1.5, ours_until - 0.3))  # the periods that ended in this window
    orphan = host.summary((ours_until + 0.8, ours_until + 1.8))
    assert child["ours"] > 0.7 and child["engines"] > 0.7 and child["others"] < 0.4
    assert orphan["others"] > 0.7 and orphan["ours"] < 0.3
    assert host.summary((host.started - 10, host.started - 5)) == {}
    requests = [{"sent_s": 0.0, "ttft_s": 0.5, "simulated_ttft_s": 0.4}, {"sent_s": 1.0, "ttft_s": None,
                                                                        "simulated_ttft_s": 0.6}]
    assert validation_png(requests, host.samples).startswith(b"\x89PNG")


def test_trace_description_on_a_hand_computed_trace():
    from serve_apps.fleet.trace import Trace, TraceRequest, describe

    trace = Trace((TraceRequest(0.0, 1000, 10, (1, 2)), TraceRequest(30.0, 1500, 20, (1, 2, 3)),
                   TraceRequest(90.0, 500, 30, (4,))), block_tokens=512)
    figures = describe(trace)
    assert figures["input_median"] == 1000 and figures["input_max"] == 1500 and figures["output_mean"] == 20
    assert figures["input_token_weighted_mean"] == pytest.approx((1000**2 + 1500**2 + 500**2) / 3000)
    # the second request repeats blocks 1 and 2 (1,024 tokens) of the first, sent 30 s before
    assert figures["repeated_prompt_token_share"] == pytest.approx(1024 / 3000)
    assert figures["reuse_gap_median_s"] == 30.0 and figures["blocks_per_request"] == 2


def test_a_report_on_the_derived_profile_says_beside_each_target_where_the_profile_misses_the_paper(tmp_path):
    from swiftkv.cli import main

    report = tmp_path / "report.yaml"
    report.write_text(
        "traffic: {synthetic: {duration_s: 60, rate: 2, input_tokens_mean: 2000, output_tokens_mean: 20}}\n"
        f"profile: {PROFILES / 'h100-llama-3.1-8b.json'}\npaper_checks: true\nvariants: [base, swiftkv-50]\n"
        "fleets: [{policy: static, router: prefill}, {policy: prefill, router: prefill}]\n"
        f"main: [base/static/prefill]\nfleet: {{score_from_s: 0}}\nout: {tmp_path / 'report'}\n")
    assert main(["fleet", "report", "--config", str(report)]) == 0
    results = json.loads((tmp_path / "report" / "results.json").read_text())
    flagged = [c for c in results["paper_checks"] if c["flagged"]]
    assert any(c["variant"] == "swiftkv-50" for c in flagged)
    # every SwiftKV target carries its variant's misses (and the base's), the report prints the whole check table
    assert results["targets"] and all("(the profile against the paper: swiftkv-50: Fig. 3, " in t["figures"]
                                      for t in results["targets"])
    text = (tmp_path / "report" / "report.md").read_text()
    assert "The profile against the paper's figures" in text and text.count("(fitted)") == 4
