"""The prefill-aware autoscaling policy as a pure function of replica load, and through Ray Serve's
own ``AutoscalingContext`` and policy wrapper (delays, bounds)."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from serve_apps.load import ReplicaLoad
from serve_apps.policy import PrefillAutoscalingPolicy, PrefillPolicyConfig, decide

MU = 1000.0  # tokens/s per replica
CFG = PrefillPolicyConfig(prefill_tokens_per_s=MU, ttft_budget_s=2.0, target_utilization=0.8,
                          downscale_utilization=0.5, kv_cache_high=0.9, kv_cache_low=0.6)


def load(rate: float = 0.0, waiting: float = 0.0, kv: float = 0.0, uncached: float = 1.0,
         preemptions: float = 0.0, finished: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(prompt_tokens_per_s=rate, prompt_tokens_waiting=waiting, kv_cache_usage=kv,
                       uncached_fraction=uncached, preemptions_per_s=preemptions, prefill_capacity=MU,
                       requests_finished_per_s=finished, timestamp=time.time())


def test_no_figures_yet_holds():
    assert decide([], 3, CFG).replicas == 3
    assert decide([load(rate=5000)], 0, CFG).replicas == 0  # Serve's cold-start path handles zero


def test_arrival_rate_over_capacity_scales_up():
    decision = decide([load(rate=1200)], 1, CFG)  # 1200 > 0.8 * 1000
    assert decision.replicas == 2 and "arrival rate" in decision.reason
    assert decide([load(rate=3000)], 1, CFG).replicas == 4  # ceil(3000 / 800)


def test_backlog_over_the_ttft_budget_scales_up():
    # 6000 waiting tokens must clear in 2 s: 3000 tok/s, three replicas, though nothing more arrives.
    decision = decide([load(waiting=6000)], 1, CFG)
    assert decision.replicas == 3 and "backlog" in decision.reason
    assert decision.backlog_tokens == 6000


def test_backlog_the_running_replicas_clear_before_a_start_asks_for_no_replica():
    # Four replicas at 2000 tok/s of arrivals clear 2000 tok/s more: in a 60 s start-up, 120,000
    # tokens. A backlog of 100,000 is gone before a replica started now could serve.
    loads = [load(rate=500, waiting=25_000)] * 4
    started_at_once = decide(loads, 4, CFG)
    assert started_at_once.replicas == 52 and "backlog" in started_at_once.reason  # (2000 + 100000 / 2) / 1000
    slow_start = CFG.model_copy(update={"replica_startup_s": 60.0})
    assert decide(loads, 4, slow_start).replicas == 4
    # What is left after the start-up still asks: 400,000 waiting, 120,000 cleared, 280,000 in 2 s.
    assert decide([load(rate=500, waiting=100_000)] * 4, 4, slow_start).replicas == 142
    # A fleet short of the arrivals clears nothing meanwhile: the whole backlog counts.
    assert decide([load(rate=1500, waiting=2_000)] * 2, 2, slow_start).replicas == 5  # (3000 + 2000) / 1000


def test_prefix_cache_hits_do_not_count_as_work():
    # The same arrivals, nine tenths served from the prefix cache: one replica keeps up.
    assert decide([load(rate=3000, waiting=6000, uncached=0.1)], 1, CFG).replicas == 1


def test_kv_cache_pressure_adds_a_replica():
    decision = decide([load(rate=100, kv=0.95)], 2 - 1, CFG)
    assert decision.replicas == 2 and "KV cache" in decision.reason


def test_preemptions_add_a_replica_and_forbid_scale_down():
    # One replica of three fills and preempts while the mean reads 50%: the cache is full there.
    loads = [load(rate=10, kv=0.98, preemptions=0.4), load(rate=10, kv=0.3), load(rate=10, kv=0.2)]
    decision = decide(loads, 3, CFG)
    assert decision.replicas == 4 and "preempting" in decision.reason
    # The same fleet without the preemptions would scale down (survivors' KV 1.48 / 2 < 0.6 fails,
    # so to the three it holds); a far emptier fleet with one preemption still may not shrink.
    assert decide([load(rate=10, kv=0.98), load(rate=10, kv=0.3), load(rate=10, kv=0.2)], 3, CFG).replicas == 3
    quiet = [load(rate=10, kv=0.1, preemptions=0.2), load(rate=10, kv=0.1), load(rate=10, kv=0.1)]
    assert decide(quiet, 3, CFG).replicas == 4
    assert decide([load(rate=10, kv=0.1)] * 3, 3, CFG).replicas == 1


def test_hysteresis_band_holds():
    # Two replicas at 1200 tok/s: one would be over 0.8 * mu, two are above 0.5 * mu each -> hold.
    assert decide([load(rate=600), load(rate=600)], 2, CFG).replicas == 2


def test_scale_down_only_when_fewer_replicas_meet_the_budget_with_room():
    # 400 tok/s over two replicas: one replica runs at 40% < 50% -> scale down to one.
    decision = decide([load(rate=200), load(rate=200)], 2, CFG)
    assert decision.replicas == 1 and "scale down" in decision.reason
    # From four replicas straight to the count that meets the budget below 50%.
    assert decide([load(rate=450)] * 4, 4, CFG).replicas == 4  # 1800 tok/s: 4 needed at 50%
    assert decide([load(rate=150)] * 4, 4, CFG).replicas == 2  # 600 tok/s: 2 at 50%


def test_kv_cache_blocks_scale_down():
    # Little prefill, but the KV cache of the survivors would be 2 * 0.4 = 0.8 > 0.6 full.
    assert decide([load(rate=10, kv=0.4), load(rate=10, kv=0.4)], 2, CFG).replicas == 2
    assert decide([load(rate=10, kv=0.2), load(rate=10, kv=0.2)], 2, CFG).replicas == 1


def test_no_flapping_across_a_load_sweep():
    """Rising then falling load: the count changes only at the ends of the band, never 2-1-2."""
    current, history = 1, []
    for rate in [300, 600, 900, 1200, 900, 700, 500, 300, 100]:
        current = decide([load(rate=rate / current)] * current, current, CFG).replicas
        history.append(current)
    assert history == [1, 1, 2, 2, 2, 2, 1, 1, 1]


def test_requests_filling_the_seats_scale_up_whatever_the_tokens():
    """A decode-bound fleet: few prompt tokens, KV under the guard, but the replicas' seats
    (max_ongoing_requests, 16 here) filling up, then requests queued at the handles."""
    cfg = CFG.model_copy(update={"max_ongoing_requests": 16})
    busy = [load(rate=50, kv=0.5)] * 2
    assert decide(busy, 2, cfg, requests=24, queued=0).replicas == 2  # 75% of 32 seats: holding
    decision = decide(busy, 2, cfg, requests=32, queued=0)
    assert decision.replicas == 3 and "over 80% of the replicas' seats" in decision.reason  # ceil(32 / 12.8)
    # Requests queued at the handles and no replica has completed one yet: one more replica.
    decision = decide(busy, 2, cfg, requests=40, queued=8)
    assert decision.replicas == 3 and "8 requests queued" in decision.reason
    # Never down while requests wait, however light the tokens.
    assert decide([load(rate=1)] * 3, 3, cfg, requests=50, queued=2).replicas == 4


def test_the_handles_queue_is_work_to_drain_not_requests_to_seat():
    """A queue of 100 requests over two full replicas that complete 2 requests/s each, growing by
    5/s: the fleet must complete 9 requests/s and drain the 100 within the horizon, at 80% of 2/s
    per replica, and never needs more than the replicas that seat all 132 at once, ceil(132 / 12.8)."""
    cfg = CFG.model_copy(update={"max_ongoing_requests": 16})
    full = [load(rate=50, kv=0.5, finished=2.0)] * 2
    # Within the 2 s budget (start-up 0) the drain would take (9 + 100 / 2) / 1.6 = 37: seats bound it.
    assert decide(full, 2, cfg, requests=132, queued=100, queue_growth_per_s=5).replicas == 11
    slow_start = cfg.model_copy(update={"replica_startup_s": 50.0})  # drained within the start-up
    assert decide(full, 2, slow_start, requests=132, queued=100, queue_growth_per_s=5).replicas == 7  # 11 / 1.6
    # A replica that has just started completes nothing yet: it is no measure of the rate.
    assert decide([*full, load(finished=0.0)], 3, slow_start, requests=148, queued=100,
                  queue_growth_per_s=5).replicas == 7
    # A draining queue asks for less: 4 - 3 = 1 request/s arriving plus 100 / 50, ceil(3 / 1.6) = 2
    # (the 20 requests at the replicas ask for 2 seats' worth too; without the growth it would be 4).
    assert decide(full, 2, slow_start, requests=120, queued=100, queue_growth_per_s=-3).replicas == 2


def test_the_policy_rates_the_queues_growth_from_its_own_state():
    """Serve keeps ``policy_state`` between control ticks: the policy samples the queue in it."""
    deployment = DeploymentID(name="model-x", app_name="swiftkv")
    r1 = ReplicaID("r1", deployment)
    full = load(rate=50, kv=0.5, finished=2.0).to_metrics()
    metrics = {name: {r1: value} for name, value in full.items()}
    policy = PrefillAutoscalingPolicy(prefill_tokens_per_s=MU, max_ongoing_requests=4, replica_startup_s=50.0)
    state: dict = {}
    wants = []
    for second, queued in enumerate([0, 10, 20, 30]):  # 10 requests/s more every second
        ctx = _context(metrics, [r1], 1, requests=(3 if second == 0 else 4) + queued, queued=queued,
                       max_replicas=20)
        ctx.policy_state, ctx.current_time = state, 1000.0 + second
        target, state = policy(ctx)
        wants.append(target)
    assert len(state["queue_samples"]) == 4
    # 2 completed + 10 more queued per second + 30 / 50, at 80% of 2/s: ceil(12.6 / 1.6) = 8, once
    # seating all the requests asks for as many (4 + 10 at 3.2 a replica: 5; 4 + 20: 8).
    assert wants == [1, 5, 8, 8]
    # The same tick with no samples kept sees no growth: (2 + 30 / 50) / 1.6, the seats' 2.
    ctx.policy_state = {}
    assert policy(ctx)[0] == 2


def test_scale_down_leaves_the_requests_half_the_seats():
    """The request count's hysteresis: down only to replicas whose seats the requests fill to 50% at
    most (scaling down to full seats made a decode-bound fleet queue and scale up again)."""
    cfg = CFG.model_copy(update={"max_ongoing_requests": 16})
    assert decide([load(rate=1)] * 3, 3, cfg, requests=20, queued=0).replicas == 3  # 2 replicas: 62%
    assert decide([load(rate=1)] * 3, 3, cfg, requests=16, queued=0).replicas == 2  # 2 replicas: 50%


def test_idle_asks_for_zero_and_serve_starts_one_for_a_request():
    assert decide([load(rate=5)], 2, CFG, requests=0).replicas == 0
    # Serve's samples missed a burst of short requests: the prompt tokens still ask for more.
    assert decide([load(rate=1200)], 1, CFG, requests=0).replicas == 2
    assert decide([], 0, CFG, requests=0).replicas == 0  # stays at zero while nothing comes
    deployment = DeploymentID(name="model-x", app_name="swiftkv")
    r1 = ReplicaID("r1", deployment)
    idle = {name: {r1: value} for name, value in load().to_metrics().items()}
    wrapped = _apply_autoscaling_config(PrefillAutoscalingPolicy(prefill_tokens_per_s=MU))
    assert wrapped(_context(idle, [r1], 1, requests=0, min_replicas=0))[0] == 0
    assert wrapped(_context(idle, [r1], 1, requests=0, min_replicas=1))[0] == 1  # bounded by min_replicas
    # Zero replicas and a request waiting: Serve's own cold start asks for one.
    assert wrapped(_context({}, [r1], 0, requests=1, min_replicas=0))[0] == 1


def test_config_is_validated():
    with pytest.raises(ValidationError, match="prefill_tokens_per_s"):
        PrefillPolicyConfig()
    with pytest.raises(ValidationError, match="hysteresis"):
        PrefillPolicyConfig(prefill_tokens_per_s=1, target_utilization=0.5, downscale_utilization=0.6)
    with pytest.raises(ValidationError, match="extra"):
        PrefillAutoscalingPolicy(prefill_tokens_per_s=1, ttft_budget=2)


def _context(metrics: dict[str, dict], replicas: list[ReplicaID], current: int, requests: float = 1.0,
             queued: float = 0.0, min_replicas: int = 1, target: int | None = None, max_replicas: int = 3,
             **config) -> AutoscalingContext:
    deployment = replicas[0].deployment_id
    config = {"upscale_delay_s": 0.0, "downscale_delay_s": 0.0, **config}
    autoscaling = AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas, **config)
    return AutoscalingContext(
        deployment_id=deployment, deployment_name=deployment.name, app_name=deployment.app_name,
        current_num_replicas=current, target_num_replicas=current if target is None else target,
        running_replicas=replicas, total_num_requests=requests, total_queued_requests=queued,
        aggregated_metrics=metrics, raw_metrics=None, capacity_adjusted_min_replicas=min_replicas,
        capacity_adjusted_max_replicas=max_replicas, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=time.time(), config=autoscaling,
    )


def test_policy_reads_serves_aggregated_metrics():
    deployment = DeploymentID(name="model-x", app_name="swiftkv")
    r1, r2, r3 = (ReplicaID(f"r{i}", deployment) for i in (1, 2, 3))
    busy, idle = load(waiting=5000).to_metrics(), load().to_metrics()
    metrics = {name: {r1: busy[name], r2: idle[name]} for name in busy}
    policy = PrefillAutoscalingPolicy(prefill_tokens_per_s=MU, ttft_budget_s=2.0)
    # r3 runs but has not published yet: it counts as a replica, not as load.
    replicas, state = policy(_context(metrics, [r1, r2, r3], 3))
    assert replicas == 3 and state["backlog_tokens"] == 5000  # 2500 tok/s needed: three replicas
    replicas, state = policy(_context(metrics, [r1, r2], 2))
    assert replicas == 3 and "backlog" in state["last_reason"]
    # A wish beyond max_replicas is capped here, and the reason says so.
    flood = load(waiting=50_000).to_metrics()
    replicas, state = policy(_context({name: {r1: flood[name]} for name in flood}, [r1], 1))
    assert replicas == 3 and "wants 25; bounds 1-3 give 3" in state["last_reason"]


def test_serves_wrapper_applies_its_delays():
    """Serve wraps the policy with its own delay logic (bounds come later, from its state manager)."""
    deployment = DeploymentID(name="model-x", app_name="swiftkv")
    r1 = ReplicaID("r1", deployment)
    busy = load(waiting=5000).to_metrics()
    metrics = {name: {r1: value} for name, value in busy.items()}
    wrapped = _apply_autoscaling_config(PrefillAutoscalingPolicy(prefill_tokens_per_s=MU))
    assert wrapped(_context(metrics, [r1], 1))[0] == 3
    # The same decision must hold for 30 s before Serve acts on it.
    assert wrapped(_context(metrics, [r1], 1, upscale_delay_s=30.0))[0] == 1
    # Scale-downs go half way with Serve's downscaling_factor: 8 quiet replicas asking for 1 get 5.
    replicas = [ReplicaID(f"r{i}", deployment) for i in range(8)]
    quiet = {name: dict.fromkeys(replicas, value) for name, value in load(rate=10).to_metrics().items()}
    assert wrapped(_context(quiet, replicas, 8, requests=8.0, max_replicas=8))[0] == 1
    assert wrapped(_context(quiet, replicas, 8, requests=8.0, max_replicas=8, downscaling_factor=0.5))[0] == 5


def test_replicas_still_starting_are_kept_while_the_fleet_is_short():
    """Two running, eight asked for: a wish of 4 (the backlog's estimate moved) keeps the eight coming;
    a wish the running replicas meet lets the starting ones go."""
    deployment = DeploymentID(name="model-x", app_name="swiftkv")
    r1, r2 = (ReplicaID(f"r{i}", deployment) for i in (1, 2))
    backlog = load(waiting=4000).to_metrics()  # 8000 tokens to clear in 2 s: 4 replicas at 1000 tok/s
    metrics = {name: {r1: backlog[name], r2: backlog[name]} for name in backlog}
    policy = PrefillAutoscalingPolicy(prefill_tokens_per_s=MU)
    replicas, state = policy(_context(metrics, [r1, r2], 2, target=8, max_replicas=10))
    assert replicas == 8 and "keeps the 8 asked for while 6 start" in state["last_reason"]
    quiet = load(rate=100).to_metrics()
    metrics = {name: {r1: quiet[name], r2: quiet[name]} for name in quiet}
    assert policy(_context(metrics, [r1, r2], 2, target=8, max_replicas=10))[0] == 1
