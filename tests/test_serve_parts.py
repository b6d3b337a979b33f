"""The Serve application's parts that need no running cluster: routing hints, the replica's load
tracker, the typed config (and its errors), vLLM's argument building, the in-process ASGI bridge,
and reading a Serve config file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from serve_apps.app import (
    autoscaling_config,
    build_app,
    deployment_name,
    deployment_options,
    ingress_capacity,
    request_router_config,
)
from serve_apps.asgi import ForwardedRequest, ResponseStart, call_asgi
from serve_apps.auth import ApiKeyMiddleware, Auth, read_api_key
from serve_apps.config import AppConfig, ModelOptions
from serve_apps.errors import as_openai_error, install_error_handlers
from serve_apps.hints import CHARS_PER_TOKEN, prompt_hint
from serve_apps.ingress import parse_body
from serve_apps.load import LoadTracker, ReplicaLoad
from serve_apps.local import read_app_config
from swiftkv.yaml_config import parse_config

REPO = Path(__file__).resolve().parents[1]


# --- routing hints ---------------------------------------------------------------------------


def test_hint_counts_token_ids_exactly_and_estimates_text():
    assert prompt_hint({"prompt": list(range(130))}).prompt_tokens == 130
    assert len(prompt_hint({"prompt": list(range(130))}).prefix_blocks) == 2  # full 64-token blocks only
    assert prompt_hint({"prompt": "x" * 400}).prompt_tokens == 400 / CHARS_PER_TOKEN
    batch = prompt_hint({"prompt": ["a" * 40, "b" * 80]})
    assert batch.prompt_tokens == 120 / CHARS_PER_TOKEN


@pytest.mark.parametrize("body", [{}, {"prompt": 5}, {"messages": "hi"}, {"messages": [3, None]}, {"prompt": []}])
def test_hint_of_unreadable_bodies_is_empty(body):
    assert prompt_hint(body).prompt_tokens == 0 and prompt_hint(body).prefix_blocks == ()


def test_hint_of_hostile_prompts_never_fails():
    """Ids out of any range and lone surrogates are the engine's to refuse (a 400), not a crash here."""
    ids = prompt_hint({"prompt": [-1, 2**40, 10**30, True] * 40})
    assert ids.prompt_tokens == 160 and len(ids.prefix_blocks) == 2
    assert prompt_hint({"prompt": "\ud800" * 600}).prefix_blocks


def test_hint_reads_content_parts():
    parts = [{"type": "text", "text": "y" * 300}, {"type": "image_url", "image_url": {"url": "x"}}]
    assert prompt_hint({"messages": [{"role": "user", "content": parts}]}).prompt_tokens > 300 / CHARS_PER_TOKEN


# --- the replica's load tracker --------------------------------------------------------------


def test_load_tracker_rates_over_its_window():
    tracker = LoadTracker(prefill_capacity=2000.0, window_s=5.0)
    assert tracker.snapshot(100.0, 0.0).prompt_tokens_per_s == 0.0  # no span yet
    tracker.on_scheduler(running=3, waiting=2, kv_cache_usage=0.25)
    tracker.on_prefill_done(prompt_tokens=1000, computed_tokens=600)  # 400 from the prefix cache
    tracker.on_first_tokens(101.0, [0.2, 0.4, 1.6])
    load = tracker.snapshot(102.0, prompt_tokens_waiting=3000.0)
    # 2 s since the first snapshot: 1000 prefilled + 3000 more waiting arrived.
    assert load.prompt_tokens_per_s == pytest.approx(2000.0)
    assert load.uncached_prompt_tokens_per_s == pytest.approx(300.0)
    assert load.uncached_fraction == pytest.approx(0.6)
    assert load.uncached_tokens_waiting == pytest.approx(1800.0)
    assert (load.running_requests, load.waiting_requests, load.kv_cache_usage) == (3, 2, 0.25)
    assert load.ttft_p90_s == 1.6 and load.prefill_capacity == 2000.0
    later = tracker.snapshot(110.0, 0.0)  # the window moved past the first samples and the TTFTs
    assert later.ttft_p90_s == 0.0 and later.uncached_prompt_tokens_per_s == 0.0
    tracker.on_preempted(3)  # vLLM's preemptions, a rate over the window like the tokens
    assert tracker.snapshot(112.0, 0.0).preemptions_per_s == pytest.approx(0.3)  # 3 over 102..112 s
    assert tracker.snapshot(120.0, 0.0).preemptions_per_s == 0.0
    tracker.on_finished(4)  # completed requests: the replica's throughput in requests
    assert tracker.snapshot(122.0, 0.0).requests_finished_per_s == pytest.approx(0.4)


def test_the_stat_logger_copies_vllms_step_figures_into_the_tracker():
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats

    from serve_apps.engine_stats import LoadStatLogger

    tracker = LoadTracker(prefill_capacity=1000.0)
    logger = LoadStatLogger(None, tracker=tracker)
    step = IterationStats()
    step.num_preempted_reqs = 2
    step.finished_requests = [object(), object(), object()]  # only their number is read
    step.prompt_token_stats.total, step.prompt_token_stats.computed = 500, 300
    logger.record(SchedulerStats(num_running_reqs=4, num_waiting_reqs=1, num_skipped_waiting_reqs=2,
                                 kv_cache_usage=0.97), step)
    assert (tracker.preempted, tracker.prefilled_tokens, tracker.computed_tokens) == (2, 500, 300)
    assert tracker.finished == 3
    assert tracker.last_step_monotonic is not None  # the step is the replica's sign of life
    assert (tracker.running, tracker.waiting, tracker.kv_cache_usage) == (4, 3, 0.97)


def test_a_busy_engine_passes_the_health_check_and_a_silent_one_is_probed():
    """Progress is liveness: an engine that stepped within the probe's timeout is not asked for a
    token (the probe would queue behind its requests); one that did not must produce it in time."""
    import time
    from types import SimpleNamespace

    from serve_apps.model_server import ModelServer

    probes = []

    class HungEngine:
        async def check_health(self) -> None:
            pass

        async def generate(self, prompt, params, request_id):
            probes.append(request_id)
            await asyncio.sleep(30)
            yield None

    tracker = LoadTracker(prefill_capacity=100.0)
    server = SimpleNamespace(engine=HungEngine(), tracker=tracker, options=ModelOptions(
        name="m", model="bundled", health_probe_timeout_s=0.2))
    check = ModelServer.func_or_class.check_health
    tracker.on_step(time.monotonic())
    asyncio.run(check(server))
    assert probes == []
    tracker.on_step(time.monotonic() - 1.0)  # no step for a second: idle or hung, so probe
    with pytest.raises(TimeoutError, match="model m: the engine produced no token within 0.2 s"):
        asyncio.run(check(server))
    assert len(probes) == 1


def test_replica_load_round_trips_through_serve_metrics():
    load = ReplicaLoad(prompt_tokens_waiting=5.0, kv_cache_usage=0.5, timestamp=3.0)
    metrics = load.to_metrics()
    assert all(isinstance(v, float) for v in metrics.values())
    assert ReplicaLoad.from_metrics({**metrics, "unknown": 1.0}) == load
    assert ReplicaLoad.from_metrics(None) == ReplicaLoad()


# --- the typed config ------------------------------------------------------------------------


def _config(**model) -> dict:
    return {"models": [{"name": "m", "model": "bundled", **model}]}


@pytest.mark.parametrize(("tree", "message"), [
    ({"models": []}, "models: List should have at least 1 item"),
    ({"modles": []}, "modles: unknown key"),
    (_config(autoscale={"max_replicas": 2}), "models.0.autoscale: unknown key"),
    (_config(autoscaling={"min_replicas": 3, "max_replicas": 2}), "max_replicas (2) is below min_replicas (3)"),
    (_config(autoscaling={"policy": "magic"}), "models.0.autoscaling.policy"),
    (_config(routing={"router": "random"}), "models.0.routing.router"),
    (_config(engine_kwargs={"trust_remote_code": True}), "engine_kwargs.trust_remote_code: SwiftKV checkpoints"),
    (_config(engine_kwargs={"api_key": "x"}), "engine_kwargs.api_key"),
    (_config(name="a b"), "use letters, digits"),
    ({**_config(), "queue_timeout_s": 60, "request_timeout_s": 30}, "queue_timeout_s (60) exceeds request_timeout_s"),
    (_config(backpressure_status=500), "models.0.backpressure_status"),
    (_config(max_queued_requests=0), "models.0.max_queued_requests"),
    ({"models": [{"name": "m", "model": "x"}, {"name": "m", "model": "y"}]}, "m appears more than once"),
])
def test_config_errors_name_the_problem(tree, message):
    with pytest.raises(ValueError) as err:
        parse_config(AppConfig, tree, what="serve config")
    assert message in str(err.value)


def test_builder_maps_the_config_onto_serve_options():
    config = parse_config(AppConfig, {"models": [
        {"name": "org/base", "model": "bundled", "prefill_tokens_per_s": 1500,
         "autoscaling": {"max_replicas": 3, "ttft_budget_s": 1.5, "replica_startup_s": 75}},
        {"name": "requests", "model": "bundled", "autoscaling": {"policy": "requests", "target_ongoing_requests": 4},
         "routing": {"router": "pow2"}},
    ]})
    prefill, requests = config.models
    assert deployment_name(prefill.name) == "model-org-base"
    scaling = autoscaling_config(prefill)
    assert scaling["policy"]["policy_function"] == "serve_apps.policy:PrefillAutoscalingPolicy"
    assert scaling["policy"]["policy_kwargs"]["prefill_tokens_per_s"] == 1500
    assert scaling["policy"]["policy_kwargs"]["replica_startup_s"] == 75
    assert scaling["max_replicas"] == 3 and scaling["metrics_interval_s"] == 1.0
    assert (scaling["downscale_delay_s"], scaling["downscaling_factor"]) == (60.0, 0.5)
    assert "policy" not in autoscaling_config(requests) and autoscaling_config(requests)["target_ongoing_requests"] == 4
    assert request_router_config(prefill)["request_router_class"] == "serve_apps.router:PrefillAwareRouter"
    assert "request_router_class" not in request_router_config(requests)  # Serve's power-of-two default
    options = deployment_options(prefill)
    assert options["max_queued_requests"] == 64 and options["backpressure_config"] == {"status_code": 503,
                                                                                       "retry_after_s": 1.0}
    assert (options["health_check_period_s"], options["health_check_timeout_s"]) == (10.0, 15.0)
    assert scaling["policy"]["policy_kwargs"]["max_ongoing_requests"] == 64
    # The ingress holds what every model can: 64 ongoing x 3 replicas + 64 queued, and 64 + 64 for the other.
    assert ingress_capacity(config) == 64 * 3 + 64 + 64 + 64 + 256
    app = build_app(config)
    assert type(app).__name__ == "Application"


def test_vllm_server_args_check_engine_kwargs_against_vllm():
    from serve_apps.vllm_app import vllm_server_args

    args = vllm_server_args(ModelOptions(name="m", model="x", engine_kwargs={"max_model_len": 512}), "/models/m")
    assert (args.model, args.served_model_name, args.max_model_len) == ("/models/m", ["m"], 512)
    assert args.additional_config["swiftkv"] == {"prefill_skipping": True}
    assert args.trust_remote_code is False
    with pytest.raises(ValueError, match=r"max_model_length is not a vLLM option \(did you mean max_model_len"):
        vllm_server_args(ModelOptions(name="m", model="x", engine_kwargs={"max_model_length": 5}), "/m")


def test_admission_stays_below_the_engines_sequence_limit():
    from vllm.config import SchedulerConfig

    from serve_apps.vllm_app import check_admission

    engine = type("Config", (), {"scheduler_config": SchedulerConfig(max_num_seqs=128, max_model_len=512,
                                                                     is_encoder_decoder=False)})()
    check_admission(ModelOptions(name="m", model="x", max_ongoing_requests=127), engine)
    with pytest.raises(ValueError, match=r"max_ongoing_requests \(128\) must be below the engine's max_num_seqs"):
        check_admission(ModelOptions(name="m", model="x", max_ongoing_requests=128), engine)


def test_read_app_config_from_a_serve_config_file_with_models_and_overrides(tmp_path):
    config = read_app_config(REPO / "serve_apps" / "smollm2-cpu.yaml", [], ["models.1.autoscaling.max_replicas=3"])
    assert [m.name for m in config.models] == ["smollm2", "smollm2-swiftkv"]
    assert config.models[1].autoscaling.max_replicas == 3
    replaced = read_app_config(REPO / "serve_apps" / "smollm2-cpu.yaml", ["a=/x/a", "/y/b/"], [])
    assert [(m.name, m.model) for m in replaced.models] == [("a", "/x/a"), ("b", "/y/b/")]
    # The second model keeps the file's first entry's settings.
    assert replaced.models[1].engine_kwargs == {"dtype": "float32", "enforce_eager": True, "max_model_len": 8192}
    other = tmp_path / "other.yaml"
    other.write_text("applications:\n- name: x\n  import_path: some.other:app\n")
    with pytest.raises(ValueError, match="no application with import_path serve_apps.app:build_app"):
        read_app_config(other, [], [])
    with pytest.raises(ValueError, match="no model to serve"):
        read_app_config(None, [], [])
    with pytest.raises(ValueError, match="is not an index"):
        read_app_config(REPO / "serve_apps" / "smollm2-cpu.yaml", [], ["models.5.name=x"])


def test_every_shipped_serve_config_validates_and_backs_its_deadline_with_serves():
    import yaml

    for path in sorted((REPO / "serve_apps").glob("*.yaml")):
        config = read_app_config(path, [], [])
        assert config.models, path
        # Serve's own deadline only backs the application's: the ingress answers first, in OpenAI's format.
        assert yaml.safe_load(path.read_text())["http_options"]["request_timeout_s"] > config.request_timeout_s


# --- the in-process ASGI bridge --------------------------------------------------------------


def _app(seen: dict) -> Starlette:
    async def echo(request: Request):
        body = await request.json()
        return JSONResponse({"got": body, "path": request.url.path, "query": request.url.query}, status_code=201)

    async def stream(request: Request):
        async def chunks():
            try:
                for i in range(100):
                    yield f"data: {i}\n\n"
                    seen["sent"] = i + 1
                    await asyncio.sleep(0.01)
            finally:
                seen["closed"] = True
        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def boom(request: Request):
        raise RuntimeError("boom")

    return Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/stream", stream, methods=["POST"]),
                             Route("/boom", boom, methods=["POST"])])


def test_asgi_bridge_returns_status_headers_and_body():
    async def run():
        request = ForwardedRequest("POST", "/echo", json.dumps({"a": 1}).encode(), b"x=2",
                                   [("content-type", "application/json")])
        return [item async for item in call_asgi(_app({}), request)]

    start, *body = asyncio.run(run())
    assert isinstance(start, ResponseStart) and start.status == 201
    assert dict(start.headers)["content-type"] == "application/json"
    assert json.loads(b"".join(body)) == {"got": {"a": 1}, "path": "/echo", "query": "x=2"}


def test_asgi_bridge_streams_and_tells_the_app_when_the_client_leaves():
    seen: dict = {}

    async def run():
        stream = call_asgi(_app(seen), ForwardedRequest("POST", "/stream"))
        start = await stream.__anext__()
        first = [await stream.__anext__() for _ in range(3)]
        await stream.aclose()  # the client went away
        await asyncio.sleep(0.1)
        return start, first

    start, first = asyncio.run(run())
    assert start.status == 200 and first == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert seen["closed"] and seen["sent"] < 10  # the app stopped streaming instead of finishing


def test_asgi_bridge_answers_an_app_error_with_500(caplog):
    async def run():
        return [item async for item in call_asgi(_app({}), ForwardedRequest("POST", "/boom"))]

    start, *_ = asyncio.run(run())
    assert start.status == 500
    assert "never retrieved" not in caplog.text


def test_asgi_bridge_raises_when_the_app_dies_without_answering():
    async def broken(scope, receive, send):
        raise KeyError("no response at all")

    async def run():
        return [item async for item in call_asgi(broken, ForwardedRequest("GET", "/"))]

    with pytest.raises(KeyError, match="no response at all"):
        asyncio.run(run())


# --- strict JSON, OpenAI errors, the API key ---------------------------------------------------


@pytest.mark.parametrize(("body", "message"), [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b'{"temperature": NaN}', "NaN is not valid JSON"),
    (b'{"temperature": -Infinity}', "-Infinity is not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
])
def test_hostile_json_is_a_400(body, message):
    response = parse_body(body)
    error = json.loads(response.body)["error"]
    assert response.status_code == 400 and message in error["message"] and error["code"] == 400


def test_non_json_error_bodies_are_rewritten_in_openai_format():
    rewritten = json.loads(as_openai_error(500, "text/plain", b"Internal Server Error"))
    assert rewritten["error"] == {"message": "Internal Server Error", "type": "InternalServerError", "param": None,
                                  "code": 500}
    assert as_openai_error(400, "application/json", b"{}") is None and as_openai_error(200, "text/plain", b"x") is None


def test_auth_fails_closed(tmp_path, monkeypatch):
    keyed, open_local, open_all = Auth("k3y", False), Auth(None, False), Auth(None, True)
    assert keyed.refusal("Bearer k3y", "203.0.113.5") is None
    assert "Incorrect or missing API key" in keyed.refusal("Bearer nope", "127.0.0.1")
    assert open_local.refusal("", "127.0.0.1") is None and open_local.refusal("", "::1") is None
    assert "answers only clients on its own host" in open_local.refusal("Bearer x", "203.0.113.5")
    assert open_local.refusal("", None) and open_all.refusal("", "203.0.113.5") is None
    (tmp_path / "key").write_text("from-file\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert read_api_key(AppConfig(models=[{"name": "m", "model": "x"}], api_key_file="~/key")) == "from-file"
    monkeypatch.setenv("SWIFTKV_API_KEY", "from-env")
    with pytest.raises(ValueError, match="insecure_no_auth is set but an API key is configured"):
        Auth.from_config(AppConfig(models=[{"name": "m", "model": "x"}], insecure_no_auth=True))


def _guarded_app(auth: Auth):
    from fastapi import FastAPI

    app = FastAPI(openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(ApiKeyMiddleware)
    app.state.auth = auth
    app.get("/health")(lambda: {"status": "ok"})
    app.get("/v1/models")(lambda: {"data": []})
    return app


@pytest.mark.parametrize(("client", "auth", "path", "method", "headers", "status"), [
    ("203.0.113.5", Auth("k", False), "/v1/models", "GET", {}, 401),
    ("203.0.113.5", Auth("k", False), "/v1/models", "GET", {"authorization": "Bearer k"}, 200),
    ("203.0.113.5", Auth("k", False), "/openapi.json", "GET", {}, 401),  # unknown routes need the key too
    ("203.0.113.5", Auth("k", False), "/openapi.json", "GET", {"authorization": "Bearer k"}, 404),
    ("203.0.113.5", Auth("k", False), "/v1/models", "DELETE", {"authorization": "Bearer k"}, 405),
    ("203.0.113.5", Auth("k", False), "/health", "GET", {}, 200),
    ("203.0.113.5", Auth(None, False), "/v1/models", "GET", {}, 401),  # no key: other hosts refused
    ("127.0.0.1", Auth(None, False), "/v1/models", "GET", {}, 200),
    ("203.0.113.5", Auth(None, True), "/v1/models", "GET", {}, 200),  # insecure_no_auth, on purpose
])
def test_api_key_middleware_and_error_handlers_on_a_real_app(client, auth, path, method, headers, status):
    import httpx

    async def call():
        transport = httpx.ASGITransport(app=_guarded_app(auth), client=(client, 4444))
        async with httpx.AsyncClient(transport=transport, base_url="http://swiftkv") as http:
            return await http.request(method, path, headers=headers)

    response = asyncio.run(call())
    assert response.status_code == status, response.text
    if status >= 400:
        error = response.json()["error"]
        assert error["code"] == status and error["type"] and error["message"]
    if status == 405:
        assert response.headers["allow"] == "GET"
