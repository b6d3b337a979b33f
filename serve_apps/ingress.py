"""The OpenAI-compatible front door: API key, body limit, routing by the request's ``model`` field,
and OpenAI-format errors for what it refuses itself.

Everything else (request schemas, validation, sampling, streaming, every other error) is vLLM's
own OpenAI app inside the model replica (``serve_apps/model_server.py``): the ingress reads the body
only as JSON to find the model and the routing hint, forwards it through the model deployment's
handle (whose request router picks the replica) and streams the replica's response back.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from serve_apps.asgi import ForwardedRequest, ResponseStart
from serve_apps.config import AppConfig
from serve_apps.hints import prompt_hint

log = logging.getLogger("ray.serve")

HEALTH_TIMEOUT_S = 10.0
# Headers a replica's response must not carry through: the ingress frames the body itself.
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "date", "server"}
REPLICA_LOST = (ActorDiedError, ActorUnavailableError, RayActorError)

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               413: "RequestTooLargeError", 503: "ServiceUnavailableError"}


def openai_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error body in OpenAI's format (the one vLLM's server and the ``openai`` client use)."""
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def sse_error(status: int, message: str) -> bytes:
    """A stream that broke after its headers were sent ends with an error event, as vLLM's do."""
    error = {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": None, "code": status}
    return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()


def read_api_key(config: AppConfig) -> str | None:
    """The API key from ``api_key_file`` or the ``api_key_env`` variable, or None (no key required)."""
    if config.api_key_file:
        path = Path(config.api_key_file)
        if not path.is_file():
            raise FileNotFoundError(f"api_key_file {path} does not exist")
        text = path.read_text().strip()
        if not text:
            raise ValueError(f"api_key_file {path} is empty")
        return text.splitlines()[0].strip()
    return os.environ.get(config.api_key_env or "", "").strip() or None


app = FastAPI(title="swiftkv", docs_url=None, redoc_url=None)


@serve.deployment(max_ongoing_requests=1000)
@serve.ingress(app)
class OpenAIIngress:
    """Routes each request to its model's deployment; see the module docstring."""

    def __init__(self, config: AppConfig, models: dict) -> None:
        self.config = config
        self.models = models  # name -> DeploymentHandle of that model's ModelServer
        self.api_key = read_api_key(config)
        if self.api_key is None:
            log.warning("swiftkv ingress: no API key configured (%s unset): every route is open",
                        config.api_key_env)

    # --- checks shared by every guarded route ---------------------------------------------

    def _unauthorized(self, request: Request) -> JSONResponse | None:
        if self.api_key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            return None
        return openai_error(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.")

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

    # --- routes ---------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> Response:
        """200 when every model's engine answers a health check, 503 naming those that do not."""
        async def check(name: str) -> str | None:
            try:
                await asyncio.wait_for(self.models[name].check_health.remote(), HEALTH_TIMEOUT_S)
                return None
            except Exception as err:  # any failure means this model cannot serve now
                return f"{name}: {type(err).__name__}"

        failures = [f for f in await asyncio.gather(*(check(n) for n in self.models)) if f]
        if failures:
            return JSONResponse({"status": "unhealthy", "models": failures}, status_code=503)
        return JSONResponse({"status": "ok", "models": list(self.models)})

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> Response:
        """The model cards of every served model, as each model's vLLM server describes itself."""
        if denied := self._unauthorized(request):
            return denied
        cards = []
        for name in self.models:
            status, _, body = await self._collect(name, ForwardedRequest("GET", "/v1/models"))
            if status != 200:
                return openai_error(503, f"model {name} did not list itself (HTTP {status}).")
            cards += json.loads(body)["data"]
        return JSONResponse({"object": "list", "data": cards})

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._forward_openai(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._forward_openai(request, "/v1/completions")

    # --- forwarding -----------------------------------------------------------------------

    async def _forward_openai(self, request: Request, path: str) -> Response:
        """Forward to vLLM's route ``path`` (the app may sit under any Serve route prefix)."""
        if denied := self._unauthorized(request):
            return denied
        body = await self._read_body(request)
        if isinstance(body, Response):
            return body
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            return openai_error(400, f"The request body is not valid JSON: {err}.")
        if not isinstance(payload, dict):
            return openai_error(400, "The request body must be a JSON object.")
        name = self._model_for(payload)
        if isinstance(name, Response):
            return name
        forwarded = ForwardedRequest(
            method="POST", path=path, body=body, query_string=request.url.query.encode(),
            headers=[(k, v) for k, v in request.headers.items() if k.lower() not in ("authorization", "host")],
            hint=prompt_hint(payload),
        )
        return await self._respond(name, forwarded)

    async def _open(self, name: str, request: ForwardedRequest):
        """Start the request on a replica: ``(first item, rest of the stream)``. A replica lost before
        it answered anything (killed, restarting) is tried once more on another one."""
        for attempt in (1, 2):
            stream = self.models[name].options(method_name="forward", stream=True).remote(request)
            try:
                return await stream.__anext__(), stream
            except REPLICA_LOST as err:
                if attempt == 2:
                    raise
                log.warning("model %s: replica lost before answering (%s); retrying on another", name,
                            type(err).__name__)

    async def _collect(self, name: str, request: ForwardedRequest) -> tuple[int, list[tuple[str, str]], bytes]:
        start, stream = await self._open(name, request)
        chunks = [chunk async for chunk in stream]
        return start.status, start.headers, b"".join(chunks)

    async def _respond(self, name: str, request: ForwardedRequest) -> Response:
        try:
            start, stream = await self._open(name, request)
        except REPLICA_LOST as err:
            return openai_error(503, f"No replica of model {name} could take the request ({type(err).__name__}); "
                                     "retry shortly.")
        assert isinstance(start, ResponseStart)
        headers = {k: v for k, v in start.headers if k.lower() not in HOP_HEADERS}
        if not headers.get("content-type", "").startswith("text/event-stream"):
            try:
                body = b"".join([chunk async for chunk in stream])
            except REPLICA_LOST as err:
                return openai_error(503, f"The replica serving this request was lost ({type(err).__name__}); "
                                         "retry it.")
            return Response(body, status_code=start.status, headers=headers)
        return StreamingResponse(self._relay(stream), status_code=start.status, headers=headers)

    async def _relay(self, stream) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                yield chunk
        except REPLICA_LOST as err:
            yield sse_error(503, f"The replica serving this stream was lost ({type(err).__name__}); retry it.")
        finally:
            stream.cancel()  # a client that went away stops the generation on the replica
