"""The fleet report's fleets, each found as an operator would: Serve's defaults read from Serve, static
fleets exact to the replica, cold starts, the run cache keyed on the code, and ratios quoted only
between fleets that both meet the SLO. Tiny traces on a hand-made replica: seconds."""

from __future__ import annotations

from ray.serve.config import AutoscalingConfig

from serve_apps.fleet.config import FleetSettings
from serve_apps.fleet.grid import FleetKind, Grid, ServeTuning
from serve_apps.fleet.profile import ModelFigures, Profile
from serve_apps.fleet.report import ReportConfig, format_report, targets
from serve_apps.fleet.run_cache import SOURCES, RunCache, code_hash, run_key
from serve_apps.fleet.serve_control import SERVE_DEFAULT_OPTIONS
from serve_apps.fleet.trace import Trace, TraceRequest


def profile(startup_s: float = 0.0) -> Profile:
    """Replicas prefilling 1,000 tokens/s, 10 ms decode steps: a 500-token prompt takes 0.5 s alone."""
    def figures(name: str, rate: float) -> ModelFigures:
        return ModelFigures(model=name, hardware="hand", prefill_tokens_per_s=rate,
                            prefill_tokens_per_s_by_input_len={1: rate}, decode_step_s_by_batch={1: 0.01},
                            kv_cache_tokens=10**6, max_num_batched_tokens=512, max_num_seqs=16, startup_s=startup_s)
    return Profile(models={"base": figures("base", 1000.0), "swiftkv-50": figures("swiftkv-50", 2000.0)})


def steady(rate: float, seconds: float) -> Trace:
    """500-token prompts at ``rate`` a second: ``rate / 2`` replicas of prefill work."""
    step = 1.0 / rate
    return Trace(tuple(TraceRequest(i * step, 500, 2, (i,)) for i in range(int(seconds * rate))), 500)


def grid(trace: Trace, startup_s: float = 0.0, cache: RunCache | None = None, **settings) -> Grid:
    fleet = FleetSettings(autoscaling={"min_replicas": 1, "max_replicas": 16}, **settings)
    return Grid(fleet, trace, {"hand": True}, profile(startup_s), 0.99, ServeTuning(targets=[1.0], delays=[(0, 5)]),
                cache)


def test_serve_defaults_are_read_from_serves_autoscaling_config():
    """Every option of the baseline's policy is what the installed Serve's AutoscalingConfig gives a
    deployment that sets none (Serve 2.60: target 2, delays 30 s up / 600 s down, metrics every 10 s,
    a 30 s look-back), and the run is Serve's request-count policy starting at the warm pool."""
    run = grid(steady(4.0, 40)).serve_defaults("base", "pow2")
    serve = AutoscalingConfig()
    assert {k: run["autoscaling"][k] for k in SERVE_DEFAULT_OPTIONS} == {k: getattr(serve, k)
                                                                          for k in SERVE_DEFAULT_OPTIONS}
    assert [run["autoscaling"][k] for k in SERVE_DEFAULT_OPTIONS] == [2.0, 30.0, 600.0, 10.0, 30.0]
    assert run["autoscaling"]["policy"] == "requests" and run["timeline"][0]["replicas"] == 1


def test_the_smallest_static_fleet_is_exact_to_the_replica():
    """10 prompts of 0.5 s each a second need at least 5 replicas; the search lands on the smallest
    passing size with the size one below it failing."""
    best = grid(steady(10.0, 60)).static("base", "prefill")
    n = best["summary"]["peak_replicas"]
    below = best["probes"][n - 1]
    assert best["probes"][n] >= 0.99 and (below == "failed (stopped early)" or below < 0.99)
    assert 5 <= n <= 7


def test_autoscaled_fleets_start_cold_and_pay_the_start_up_time():
    """Ours starts at the warm pool (1 replica) and its first new replica is ready no sooner than the
    profile's 20 s start-up after it was asked for."""
    run = grid(steady(10.0, 120), startup_s=20.0).ours("base", "prefill")
    timeline = run["timeline"]
    assert timeline[0]["replicas"] == 1 and max(row["replicas"] for row in timeline) > 1
    asked = next(row["t"] for row in timeline if row["replicas"] > 1)
    assert all(row["ready"] == 1 for row in timeline if row["t"] < asked + 20.0 - 10.0)


def test_a_run_made_by_other_code_is_computed_again(tmp_path):
    """The cache key covers the sources: the same config with a changed source file is a new key."""
    source = tmp_path / "simulator.py"
    source.write_text("STEP = 1\n")
    code = code_hash((source,))
    before = run_key({"fleet": 1}, code)
    assert run_key({"fleet": 1}, code) == before and run_key({"fleet": 2}, code) != before
    source.write_text("STEP = 2\n")
    assert run_key({"fleet": 1}, code_hash((source,))) != before
    cache = RunCache(str(tmp_path / "runs"))
    cache.put("base/static/pow2 x3", before, {"summary": {"replica_hours": 1.0}})
    assert cache.get("base/static/pow2 x3", before) == {"summary": {"replica_hours": 1.0}}
    assert cache.get("base/static/pow2 x3", run_key({"fleet": 1}, code_hash((source,)))) is None
    assert run_key({"fleet": 1}) == run_key({"fleet": 1}, code_hash(SOURCES))  # the loaded code by default


def _summary(hours: float, goodput: float, attainment: float) -> dict:
    return {"replica_hours": hours, "goodput_per_replica_hour": goodput, "feasible_slo_attainment": attainment,
            "slo_attainment": attainment, "stopped_early": False, "peak_replicas": 4, "scale_events": 0,
            "scale_events_per_hour": 0.0, "uncached_prompt_share": 1.0, "preemptions": 0,
            "ttft_s": {"p50": 0.1, "p90": 0.5, "p99": 1.0}}


def test_a_ratio_is_quoted_only_between_fleets_that_both_meet_the_slo():
    cfg = ReportConfig(traffic={"trace": "unused.jsonl"}, profile="unused.json", variants=["base", "swiftkv-50"],
                       fleets=[FleetKind(policy="serve-defaults", router="pow2"),
                               FleetKind(policy="prefill", router="prefill")])
    scaling = {"target_ongoing_requests": 2.0, "upscale_delay_s": 30.0, "downscale_delay_s": 600.0}
    runs = {"base/serve-defaults/pow2": {"summary": _summary(10.0, 1000.0, 0.97), "autoscaling": scaling},
            "base/prefill/prefill": {"summary": _summary(6.0, 1500.0, 0.995), "autoscaling": {}},
            "swiftkv-50/prefill/prefill": {"summary": _summary(4.0, 2500.0, 0.995), "autoscaling": {}}}
    checks = targets(cfg, runs, profile())
    assert checks[0]["figures"] == "not quoted: base/serve-defaults/pow2 misses the SLO (97.00%)"
    assert checks[0]["met"] is False
    assert checks[1]["figures"] == "0.67x the replica-hours, 1.67x the goodput per replica-hour"
    assert checks[1]["met"] is None
    runs["base/serve-defaults/pow2"]["summary"] = _summary(10.0, 1000.0, 0.992)
    checks = targets(cfg, runs, profile())
    assert checks[0]["figures"] == "0.40x the replica-hours, 2.50x the goodput per replica-hour" and checks[0]["met"]
    text = format_report(cfg, runs, checks)
    assert "| base | Serve defaults (target 2, delays 30 / 600 s) | pow2 | yes | 10.0 |" in text
