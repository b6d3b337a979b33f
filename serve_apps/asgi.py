"""Calling an ASGI app in-process, one HTTP request at a time, with the response streamed back.

The ingress forwards each OpenAI request to a model replica through a Serve deployment handle; the
replica hands it to vLLM's own OpenAI app as if it had come over HTTP, so every route, validation
and error of vLLM's server applies unchanged. This module is that bridge: a request as plain data,
and an async generator of the response (first its status and headers, then body chunks). The
replica puts an :class:`Accepted` before the response, so the ingress knows whether a failure came
before or after a replica took the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from serve_apps.hints import PromptHint

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


@dataclass
class ForwardedRequest:
    """An HTTP request as the ingress received it, plus the routing hint it computed."""

    method: str
    path: str
    body: bytes = b""
    query_string: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    hint: PromptHint = field(default_factory=lambda: PromptHint(0.0))
    avoid_replicas: tuple[str, ...] = ()
    """Replicas that already failed this request (a retry): the router ranks them last."""


@dataclass
class Accepted:
    """The first item a replica yields: it has taken the request (nothing has run yet)."""

    replica_id: str


@dataclass
class ResponseStart:
    """The first item of a forwarded response: status and headers."""

    status: int
    headers: list[tuple[str, str]]


def _scope(request: ForwardedRequest) -> dict[str, Any]:
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers
               if k.lower() not in ("content-length", "host", "transfer-encoding")]
    headers += [(b"host", b"replica"), (b"content-length", str(len(request.body)).encode())]
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 0),
        "server": ("replica", 80),
    }


async def call_asgi(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``request`` through ``app``; yield a :class:`ResponseStart`, then the body chunks.

    Closing the generator early (the client went away) tells the app the client disconnected, so
    vLLM aborts the generation instead of finishing it for nobody.
    """
    messages: asyncio.Queue[dict] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    task = asyncio.create_task(app(_scope(request), receive, send))
    try:
        while True:
            getter = asyncio.ensure_future(messages.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():  # the app returned (or raised) with nothing more queued
                getter.cancel()
                task.result()  # re-raise the app's own error, if any
                if messages.empty():
                    raise RuntimeError(f"{request.method} {request.path}: the app ended without a complete response")
                continue
            message = getter.result()
            if message["type"] == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                yield ResponseStart(message["status"], headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()
        if not task.done():
            # Give the app a moment to see the disconnect and clean up (vLLM aborts the request).
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), timeout=5)
            task.cancel()
        elif not task.cancelled():
            task.exception()  # an error after a complete response (Starlette re-raises after its 500)
