"""Errors in OpenAI's format (``{"error": {"message", "type", "param", "code"}}``, what vLLM's server
and the ``openai`` client use) for everything the application answers itself: refusals, deadlines,
lost replicas, unknown routes and methods, and any unexpected failure, as responses and as the
last event of a stream."""

from __future__ import annotations

import json
import logging
import math

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("ray.serve")

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLargeError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError", 504: "TimeoutError"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


def openai_error(status: int, message: str, param: str | None = None,
                 retry_after_s: float | None = None) -> JSONResponse:
    """An error response; ``retry_after_s`` adds a ``Retry-After`` header (whole seconds, rounded up)."""
    headers = {"retry-after": str(math.ceil(retry_after_s))} if retry_after_s is not None else None
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def sse_error(status: int, message: str) -> bytes:
    """The end of a stream that broke after its headers were sent: an error event, then ``[DONE]``
    (as vLLM ends its own streams on an error)."""
    return f"data: {json.dumps(error_body(status, message))}\n\ndata: [DONE]\n\n".encode()


def as_openai_error(status: int, content_type: str, body: bytes) -> bytes | None:
    """An error body that is not JSON (a framework's plain-text 500, say) rewritten in OpenAI's
    format; None when ``body`` needs no rewriting."""
    if status < 400 or content_type.startswith("application/json"):
        return None
    text = body.decode("utf-8", errors="replace").strip()[:500] or f"HTTP {status}"
    return json.dumps(error_body(status, text)).encode()


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    messages = {404: f"No route {request.url.path}: the API is under /v1 (chat/completions, completions, "
                     "models).",
                405: f"Method {request.method} is not allowed on {request.url.path}."}
    response = openai_error(exc.status_code, messages.get(exc.status_code, str(exc.detail)))
    if exc.headers:  # a 405's Allow header
        response.headers.update(exc.headers)
    return response


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("swiftkv ingress: %s %s failed", request.method, request.url.path)
    return openai_error(500, f"Internal error ({type(exc).__name__}); the request was not completed.")


def install_error_handlers(app: FastAPI) -> None:
    """Unknown routes (404), wrong methods (405) and unexpected errors (500) in OpenAI's format."""
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
