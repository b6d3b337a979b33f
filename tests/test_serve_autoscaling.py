"""Autoscaling on a real local Serve: the prefill-aware policy scales 1 -> 2 -> 1 under a bounded load
of long prompts, while Serve's request-count policy, given the same request rate of short prompts,
holds at 1; a model with ``min_replicas: 0`` starts with no replica, gets one for its first request
(Serve's cold start) and goes back to zero when idle.

Tiny models keep the machine free: the policy reads the replicas' measured prompt-token arrival
rate and backlog against the configured capacity (300 tokens/s here), so one 900-token prompt a
second is over capacity whatever the model computes, and a 20-token one is not.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from serve_apps.app import deployment_name
from swiftkv.bundled import copy_bundled_tokenizer
from tests.serve_cluster import CPU_ENV, local_serve, replica_states, wait_for
from tests.test_vllm_serving import prompt
from tests.tiny import tiny_swiftkv_model

SCALING = {"min_replicas": 1, "max_replicas": 2, "look_back_period_s": 2.0, "metrics_interval_s": 0.5,
           "upscale_delay_s": 1.0, "downscale_delay_s": 6.0}
MAX_REQUESTS = 150  # per model: the load is bounded in requests as well as in time
QUEUE_TIMEOUT_S = 300  # a first request waits for a replica to start (a cold start) up to this long


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("scaling")
    tiny_swiftkv_model("llama", num_hidden_layers=4, num_key_value_layers=2, hidden_size=128).save_pretrained(root)
    copy_bundled_tokenizer(root)
    engine = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024}
    common = {"model": str(root), "env": CPU_ENV, "engine_kwargs": engine, "prefill_tokens_per_s": 300,
              "graceful_shutdown_timeout_s": 5}
    config = {"queue_timeout_s": QUEUE_TIMEOUT_S, "request_timeout_s": QUEUE_TIMEOUT_S + 30, "models": [
        {"name": "prefill-scaled", **common, "autoscaling": {**SCALING, "ttft_budget_s": 2.0}},
        {"name": "requests-scaled", **common, "routing": {"router": "pow2"},
         "autoscaling": {**SCALING, "policy": "requests", "target_ongoing_requests": 2}},
        {"name": "zero-scaled", **common, "autoscaling": {**SCALING, "min_replicas": 0, "max_replicas": 1}},
    ]}
    with local_serve(config) as endpoint:
        yield endpoint


def _running(deployment: str) -> int:
    return replica_states(deployment).get("RUNNING", 0)


def test_prefill_policy_scales_1_2_1_while_the_request_policy_holds(endpoint):
    client = openai.OpenAI(base_url=endpoint.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prefill, requests = deployment_name("prefill-scaled"), deployment_name("requests-scaled")
    wait_for(lambda: _running(prefill) == 1 and _running(requests) == 1, 120, "one replica each")
    request_counts: set[int] = set()
    errors: list[Exception] = []

    def send(model: str, length: int, i: int) -> None:
        try:
            client.completions.create(model=model, prompt=prompt(length, seed=i), max_tokens=2)
        except openai.APIError as err:
            errors.append(err)

    started, reached = time.monotonic(), None
    pool = ThreadPoolExecutor(8)
    try:
        # One long prompt (to the prefill policy's model) and one short prompt (to the request
        # policy's) per second, until the second prefill replica runs, for at most 150 s.
        for i in range(MAX_REQUESTS):
            pool.submit(send, "prefill-scaled", 900, i)
            pool.submit(send, "requests-scaled", 20, 10_000 + i)
            states = replica_states(requests)
            request_counts.add(sum(states.get(s, 0) for s in ("RUNNING", "STARTING", "UPDATING")))
            if _running(prefill) == 2:
                reached = time.monotonic() - started
                break
            time.sleep(1.0)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    assert reached is not None, "the prefill-aware policy did not reach 2 running replicas"
    assert request_counts == {1}, f"the request-count policy changed its replica count: {request_counts}"
    assert not errors, errors[:3]
    # The load is over: back to one replica once downscale_delay_s has passed.
    wait_for(lambda: replica_states(prefill) == {"RUNNING": 1}, 120, "the scale-down to one replica")
    assert replica_states(requests) == {"RUNNING": 1}
    print(f"prefill-aware policy: second replica running {reached:.0f} s after the load began")


def test_min_replicas_zero_starts_for_the_first_request_and_goes_back_to_zero(endpoint):
    import requests as http

    client = openai.OpenAI(base_url=endpoint.url + "/v1", api_key="unused", max_retries=0, timeout=QUEUE_TIMEOUT_S)
    zero = deployment_name("zero-scaled")
    assert _running(zero) == 0  # nothing started at deploy time, yet the model counts as ready
    ready = http.get(endpoint.url + "/health/ready", timeout=30).json()
    assert ready["models"]["zero-scaled"] == {"ready": True, "running_replicas": 0, "status": "HEALTHY"}
    started = time.monotonic()
    # The request waits (within queue_timeout_s) while Serve's cold start brings up a replica for it.
    assert client.completions.create(model="zero-scaled", prompt="wake up", max_tokens=2).usage.completion_tokens == 2
    print(f"cold start: answered after {time.monotonic() - started:.0f} s")
    assert _running(zero) == 1
    # Idle: the policy asks for zero, Serve applies it after downscale_delay_s.
    wait_for(lambda: not replica_states(zero), 120, "the scale-down to zero replicas")
