"""Routing and reliability on a real local Serve: two replicas of the bundled SmolLM2-135M (real
prefill cost on CPU). The prefill-aware router prefers an idle replica over one with a long prompt
queued, and a replica killed by its pid under a bounded load is replaced by Serve while the other
keeps answering, every request ending answered or refused with a status; the through-Serve
calibration and the validation's front-end measurement and repeated replay run on it."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import openai
import psutil
import pytest

from serve_apps.app import deployment_name
from tests.serve_cluster import APP, CPU_ENV, local_serve, replica_states, wait_for
from tests.test_vllm_serving import prompt


@pytest.fixture(scope="module")
def endpoint():
    config = {"models": [{
        "name": "routed", "model": "bundled", "env": CPU_ENV, "prefill_tokens_per_s": 300,
        "engine_kwargs": {"dtype": "float32", "enforce_eager": True, "max_model_len": 4096,
                          "enable_prefix_caching": False},
        "graceful_shutdown_timeout_s": 10,
        "autoscaling": {"min_replicas": 2, "max_replicas": 2}, "routing": {"stats_period_s": 0.5},
    }]}
    with local_serve(config) as endpoint:
        yield endpoint


@pytest.fixture
def client(endpoint):
    return openai.OpenAI(base_url=endpoint.url + "/v1", api_key="unused", max_retries=0, timeout=180)


def _start_stream(client, model: str, ids: list[int], max_tokens: int):
    """Open a streaming completion; return (serving replica, stream, when its first token came). The
    ingress answers a stream once its first token is out (a replica lost before it is retried)."""
    raw = client.completions.with_raw_response.create(model=model, prompt=ids, max_tokens=max_tokens, stream=True,
                                                      temperature=0.0, extra_body={"ignore_eos": True})
    return raw.headers["x-swiftkv-replica"], raw.parse(), time.monotonic()


def test_router_prefers_the_idle_replica_over_one_with_a_long_prompt_queued(client):
    with ThreadPoolExecutor(4) as pool:
        long = pool.submit(_start_stream, client, "routed", prompt(3500, seed=1), 2)
        time.sleep(0.5)  # routed long since; its prefill takes seconds on CPU
        # Two short requests with long outputs: they go to the other replica and keep it busy decoding.
        busy = [pool.submit(_start_stream, client, "routed", prompt(16, seed=2 + i), 48) for i in range(2)]
        time.sleep(0.5)
        # Serve's power-of-two router would now pick the long prompt's replica (1 request in flight
        # against 2); the prefill-aware router sees 3,500 tokens waiting there and picks the other.
        sent = time.monotonic()
        short_replica, short_stream, short_first = _start_stream(client, "routed", prompt(16, seed=9), 2)
        long_replica, long_stream, long_first = long.result()
        busy = [b.result() for b in busy]
        assert long_first > sent, "the long prompt's prefill ended before the short request was sent"
        assert long_replica not in {r for r, _, _ in busy} and short_replica != long_replica
        assert short_first < long_first
        for stream in [long_stream, short_stream, *(b[1] for b in busy)]:
            assert list(stream)  # every stream runs to its end


def test_calibration_through_the_endpoint_measures_both_replicas_curves(endpoint):
    """`swiftkv fleet calibrate-serve`'s measurement on this real endpoint: bursts of fresh prompts
    through Serve (every request answered with exactly the tokens asked, or it raises), prefill rates
    by length and decode steps by batch and context, all positive."""
    from serve_apps.fleet.config import ServeCalibration
    from serve_apps.fleet.replay import Burst
    from serve_apps.fleet.serve_profile import measure

    cal = ServeCalibration(input_lens=[16, 256], batches=[1, 4], decode_contexts=[64], decode_context_tokens=16,
                           num_prompts=1, decode_tokens=8, rounds=1)
    curves = measure(Burst(endpoint.url, "routed", 180), 2, cal, rounds=1)
    assert set(curves["prefill_tokens_per_s_by_input_len"]) == {16, 256}
    assert all(v > 0 for v in curves["prefill_tokens_per_s_by_input_len"].values())
    steps = curves["decode_step_s_by_batch"]
    assert set(steps) == {1, 4} and steps[1] > 0 and curves["decode_step_s_by_context"][64] > 0
    assert curves["decode_context_batch"] == 4


def test_the_front_end_is_measured_through_the_endpoint(endpoint):
    """`swiftkv fleet validate`'s front-end measurement on this real endpoint: lone prompts and
    bursts of one prompt per replica, every request answered; both figures non-negative and
    together under three lone short prompts' TTFT (a pair put on one replica, the second waiting for
    the first's prefill, or a front end that queued whole requests would not be)."""
    from serve_apps.fleet.config import FrontEndCalibration
    from serve_apps.fleet.front_end import measure_front_end
    from serve_apps.fleet.profile import ReplicaCosts, load_profile
    from serve_apps.fleet.replay import Burst

    profile = Path(__file__).resolve().parents[1] / "serve_apps" / "fleet" / "profiles" / "cpu-smollm2.json"
    costs = ReplicaCosts.from_figures(load_profile(profile).figures("swiftkv-50"))
    burst = Burst(endpoint.url, "routed", 180)
    lone = burst.send(1, 16, 1)[0]["ttft_s"]
    front = measure_front_end(burst, 2, costs, FrontEndCalibration(pair_prompt_tokens=64, rounds=2, pause_s=1.5))
    assert set(front) == {"ingress_s", "ingress_latency_s"}
    assert front["ingress_s"] >= 0 and front["ingress_latency_s"] >= 0
    assert front["ingress_s"] + front["ingress_latency_s"] < 3 * lone


def test_the_validation_replays_its_slice_in_passes_through_the_endpoint(endpoint):
    """`swiftkv fleet validate`'s repeated replay on this real endpoint: two passes of a three-request
    slice, every request answered with its tokens, each pass after the last one's end and the pause."""
    from serve_apps.fleet.host_load import HostLoad
    from serve_apps.fleet.trace import Trace, TraceRequest
    from serve_apps.fleet.validate import ValidateConfig, pooled_figures, replay_passes

    trace = Trace((TraceRequest(0.0, 32, 2, (1, 2)), TraceRequest(0.2, 48, 2, (1, 2, 3)),
                   TraceRequest(0.4, 32, 2, (4, 5))), 16)
    cfg = ValidateConfig(traffic={"trace": "unused.jsonl"}, replays=2, replay_pause_s=0.5, request_timeout_s=180)
    with HostLoad() as host:
        passes = replay_passes(endpoint.url, "routed", trace, cfg, host)
    assert [[m["pass"] for m in one] for one in passes] == [[0, 0, 0], [1, 1, 1]]
    assert all(m["output_tokens"] == 2 and m["ttft_s"] > 0 for one in passes for m in one)
    first_end = passes[0][0]["pass_start_s"] + max(m["sent_s"] + m["latency_s"] for m in passes[0])
    assert passes[1][0]["pass_start_s"] >= first_end + 0.5
    assert pooled_figures(passes)["requests"] == 6


def _replica_pids(deployment: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if f"ServeReplica:{APP}:{deployment}" in " ".join(p.info["cmdline"] or [])
            and ".initialize" not in " ".join(p.info["cmdline"] or [])]


def test_killed_replica_is_replaced_while_the_other_keeps_answering(client):
    deployment = deployment_name("routed")
    wait_for(lambda: replica_states(deployment).get("RUNNING") == 2, 180, "both replicas running")
    outcomes: list[tuple[float, str]] = []  # (finish time, "ok" or the HTTP status of the refusal)
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            result = client.completions.create(model="routed", prompt=prompt(200, seed=100 + i), max_tokens=24,
                                               temperature=0.0, extra_body={"ignore_eos": True}, timeout=90)
            outcome = "ok" if result.usage.completion_tokens == 24 else "short"
        except openai.APIStatusError as err:
            outcome = f"HTTP {err.status_code}"
        with lock:
            outcomes.append((time.monotonic(), outcome))

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, i) for i in range(24)]
        wait_for(lambda: len(outcomes) >= 4, 120, "the first answers")
        victim = _replica_pids(deployment)[0]
        killed_at = time.monotonic()
        psutil.Process(victim).kill()
        done, pending = wait(futures, timeout=300)
    assert not pending, "requests hung past their timeout"
    kinds = [kind for _, kind in outcomes]
    # Every request ended answered or refused with a status (never a hang or a dropped connection)...
    assert all(kind == "ok" or kind.startswith("HTTP 5") for kind in kinds), kinds
    # ...and the surviving replica kept answering after the kill.
    assert sum(1 for t, kind in outcomes if t > killed_at and kind == "ok") >= 4, outcomes
    wait_for(lambda: replica_states(deployment).get("RUNNING") == 2 and victim not in _replica_pids(deployment),
             240, "Serve to replace the killed replica")
    assert client.completions.create(model="routed", prompt="again", max_tokens=2).usage.completion_tokens == 2

