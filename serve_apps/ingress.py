"""The OpenAI-compatible front door: API key, body limit, strict JSON, routing by the request's
``model`` field, health, and OpenAI-format errors for what it refuses itself.

Everything else (request schemas, validation, sampling, streaming, every other error) is vLLM's
own OpenAI app inside the model replica (``serve_apps/model_server.py``): the ingress reads the body
only as JSON to find the model and the routing hint, and forwards it through the model deployment's
handle (``serve_apps/forwarding.py``: queue limits, deadline, retries) to the replica the request
router picks.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from serve_apps.asgi import ForwardedRequest
from serve_apps.auth import ApiKeyMiddleware, Auth
from serve_apps.config import AppConfig
from serve_apps.errors import install_error_handlers, openai_error
from serve_apps.forwarding import Limits, ModelCall, forward_handle
from serve_apps.hints import prompt_hint

log = logging.getLogger("ray.serve")

# The schema names every route and model field; it is not served at all (no /openapi.json, no docs).
app = FastAPI(title="swiftkv", docs_url=None, redoc_url=None, openapi_url=None)
install_error_handlers(app)
app.add_middleware(ApiKeyMiddleware)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_body(body: bytes) -> dict | JSONResponse:
    """The request body as a JSON object, or a 400 saying what is wrong with it (strict JSON: no
    NaN or Infinity; nesting and integer sizes bounded by Python's own limits)."""
    try:
        payload = json.loads(body, parse_constant=_refuse_constant)
    except RecursionError:
        return openai_error(400, "The request body is nested too deeply.")
    except (UnicodeDecodeError, ValueError) as err:  # JSONDecodeError, NaN, integers over 4,300 digits
        return openai_error(400, f"The request body is not valid JSON: {err}.")
    if not isinstance(payload, dict):
        return openai_error(400, "The request body must be a JSON object.")
    return payload


@serve.deployment
@serve.ingress(app)
class OpenAIIngress:
    """Routes each request to its model's deployment; see the module docstring."""

    def __init__(self, config: AppConfig, models: dict) -> None:
        self.config = config
        self.models = {name: forward_handle(handle) for name, handle in models.items()}
        self.limits = {m.name: Limits(config.queue_timeout_s, m.retry_after_s) for m in config.models}
        self.min_replicas = {m.name: m.autoscaling.min_replicas for m in config.models}
        self.cards: dict[str, list[dict]] = {}  # each model's card, as its vLLM server gives it (fixed)
        app.state.auth = Auth.from_config(config)
        if app.state.auth.key is None:
            log.warning("swiftkv ingress: %s", "no API key and insecure_no_auth: every client is served"
                        if config.insecure_no_auth else "no API key configured: only clients on this host are served")

    async def _read_body(self, request: Request) -> bytes | JSONResponse:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            return openai_error(413, f"Request body of {declared} bytes exceeds the limit of {limit} bytes.")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return openai_error(413, f"Request body exceeds the limit of {limit} bytes.")
        return bytes(body)

    def _model_for(self, payload: dict) -> str | JSONResponse:
        name = payload.get("model")
        if name is None and len(self.models) == 1:
            return next(iter(self.models))
        if not isinstance(name, str):
            return openai_error(400, f"'model' must name one of the served models: {', '.join(self.models)}.",
                                "model")
        if name not in self.models:
            return openai_error(404, f"The model `{name}` does not exist.", "model")
        return name

    def _call(self, name: str, request: ForwardedRequest, streaming: bool) -> ModelCall:
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        return ModelCall(name, self.models[name], request, streaming, self.limits[name], deadline)

    # --- routes ---------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> Response:
        """Liveness: the ingress itself answers (no model is asked, nothing waits behind requests)."""
        return JSONResponse({"status": "ok"})

    @app.get("/health/ready")
    async def ready(self, request: Request) -> Response:
        """Readiness: 200 when every model can serve (a replica passing Serve's health check, the
        engine's one-token generation, or a model scaled to zero that Serve will start), else 503.
        Per-model detail only for a caller every other route would serve."""
        applications = (await asyncio.to_thread(serve.status)).applications
        deployments = applications[serve.get_replica_context().app_name].deployments
        models = {}
        for name, handle in self.models.items():
            deployment = deployments.get(handle.deployment_name)
            running = dict(deployment.replica_states).get("RUNNING", 0) if deployment else 0
            status = str(getattr(deployment.status, "value", deployment.status)) if deployment else "MISSING"
            scaled_to_zero = self.min_replicas[name] == 0 and status == "HEALTHY"
            models[name] = {"ready": running > 0 or scaled_to_zero, "running_replicas": running, "status": status}
        ready = all(m["ready"] for m in models.values())
        body: dict = {"status": "ready" if ready else "unavailable"}
        client = request.client.host if request.client else None
        if app.state.auth.refusal(request.headers.get("authorization", ""), client) is None:
            body["models"] = models
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def list_models(self) -> Response:
        """The model cards of every served model, as each model's vLLM server describes itself."""
        for name in self.models:
            if name not in self.cards:
                response = await self._call(name, ForwardedRequest("GET", "/v1/models"), streaming=False).respond()
                if response.status_code != 200:
                    return response
                self.cards[name] = json.loads(response.body)["data"]
        return JSONResponse({"object": "list", "data": [card for name in self.models for card in self.cards[name]]})

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._forward_openai(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._forward_openai(request, "/v1/completions")

    async def _forward_openai(self, request: Request, path: str) -> Response:
        """Forward to vLLM's route ``path`` (the app may sit under any Serve route prefix)."""
        body = await self._read_body(request)
        if isinstance(body, Response):
            return body
        payload = parse_body(body)
        if isinstance(payload, Response):
            return payload
        name = self._model_for(payload)
        if isinstance(name, Response):
            return name
        forwarded = ForwardedRequest(
            method="POST", path=path, body=body, query_string=request.url.query.encode(),
            headers=[(k, v) for k, v in request.headers.items() if k.lower() not in ("authorization", "host")],
            hint=prompt_hint(payload),
        )
        return await self._call(name, forwarded, streaming=payload.get("stream") is True).respond()
