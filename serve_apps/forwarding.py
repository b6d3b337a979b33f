"""One OpenAI request through a model deployment's handle, with a deadline and clear retry rules.

- **Queue.** Serve's handle holds the request while every replica is at ``max_ongoing_requests``, up
  to ``max_queued_requests`` (then it refuses at once: :class:`BackPressureError`, answered with its
  status and ``Retry-After``). A request no replica has accepted within ``queue_timeout_s`` is a 503
  with ``Retry-After``; a deployment Serve gave up on is a 503 at once.
- **Deadline.** Past ``request_timeout_s`` the request is cancelled on its replica (the engine
  aborts it and frees its KV cache): a 504, or for a stream an error event and ``[DONE]``.
- **Retries.** Once, on another replica, and only what produced nothing: a replica lost before it
  accepted the request or before the first streamed chunk, or a 503 from a replica (its engine
  died). A non-streaming request whose replica is lost after accepting it is a 503, not rerun: its
  generation may have run.
- **Errors.** Every failure is an OpenAI error body; a stream always ends with ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi.responses import Response, StreamingResponse
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from serve_apps.asgi import Accepted, ForwardedRequest, ResponseStart
from serve_apps.errors import as_openai_error, openai_error, sse_error

log = logging.getLogger("ray.serve")

REPLICA_LOST = (ActorDiedError, ActorUnavailableError, RayActorError)
# Headers a replica's response must not carry through: the ingress frames the body itself.
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "date", "server"}


@dataclass(frozen=True)
class Limits:
    """A model's limits as the ingress applies them."""

    queue_timeout_s: float
    retry_after_s: float


def forward_handle(handle):
    """A model deployment's handle set to stream its replicas' ``forward``."""
    return handle.options(method_name="forward", stream=True)


class _Retry(Exception):
    """The attempt produced nothing: try once more, avoiding ``replica``."""

    def __init__(self, replica: str | None, why: str) -> None:
        super().__init__(why)
        self.replica = replica


class ModelCall:
    """One request to one model, answered before ``deadline`` (the event loop's clock); ``handle``
    streams the model deployment's ``forward`` (:func:`forward_handle`)."""

    def __init__(self, name: str, handle, request: ForwardedRequest, streaming: bool, limits: Limits,
                 deadline: float) -> None:
        self.name, self.handle, self.request, self.streaming = name, handle, request, streaming
        self.limits, self.deadline = limits, deadline

    async def respond(self) -> Response:
        try:
            try:
                return await self._attempt(self.request, retry_allowed=True)
            except _Retry as retry:
                log.warning("model %s: %s; retrying once on another replica", self.name, retry)
                avoid = (retry.replica,) if retry.replica else ()
                return await self._attempt(replace(self.request, avoid_replicas=avoid), retry_allowed=False)
        except BackPressureError as err:
            return openai_error(err.status_code, f"Model {self.name} is at capacity: every replica is busy and "
                                "its queue is full. Retry shortly.", retry_after_s=err.retry_after_s)
        except DeploymentUnavailableError:
            return openai_error(503, f"Model {self.name} is unavailable: its deployment failed or is being removed.",
                                retry_after_s=self.limits.retry_after_s)
        except REPLICA_LOST as err:
            return openai_error(503, f"No replica of model {self.name} could take the request "
                                f"({type(err).__name__}). Retry shortly.", retry_after_s=self.limits.retry_after_s)

    def _remaining(self) -> float:
        return self.deadline - asyncio.get_running_loop().time()

    def _timed_out(self, waited_for_replica: bool) -> Response:
        if waited_for_replica and self._remaining() > 0:
            return openai_error(503, f"No replica of model {self.name} was free within "
                                f"{self.limits.queue_timeout_s:g} s. Retry shortly.",
                                retry_after_s=self.limits.retry_after_s)
        return openai_error(504, "The request did not complete within its deadline; it was cancelled.")

    async def _attempt(self, request: ForwardedRequest, retry_allowed: bool) -> Response:
        stream = self.handle.remote(request)
        relayed = False
        try:
            response = await self._answer(stream, retry_allowed)
            relayed = isinstance(response, StreamingResponse)
            return response
        finally:
            if not relayed:  # done, failed, timed out, or the client left: stop it on the replica
                stream.cancel()

    async def _answer(self, stream, retry_allowed: bool) -> Response:
        loop = asyncio.get_running_loop()
        replica = None
        try:
            try:
                async with asyncio.timeout_at(min(self.deadline, loop.time() + self.limits.queue_timeout_s)):
                    accepted = await stream.__anext__()
            except TimeoutError:
                return self._timed_out(waited_for_replica=True)
            assert isinstance(accepted, Accepted)
            replica = accepted.replica_id
            async with asyncio.timeout_at(self.deadline):
                start = await stream.__anext__()
                assert isinstance(start, ResponseStart)
                if start.status == 503 and retry_allowed:
                    raise _Retry(replica, f"replica {replica} answered 503")
                headers = {k: v for k, v in start.headers if k.lower() not in HOP_HEADERS}
                content_type = headers.get("content-type", "")
                if self.streaming and content_type.startswith("text/event-stream"):
                    first = await anext(stream, b"")
                    return StreamingResponse(self._relay(first, stream), status_code=start.status, headers=headers)
                body = b"".join([chunk async for chunk in stream])
        except TimeoutError:
            return self._timed_out(waited_for_replica=False)
        except REPLICA_LOST as err:
            if retry_allowed and (replica is None or self.streaming):
                raise _Retry(replica, f"replica lost before any output ({type(err).__name__})") from None
            if replica is None:
                raise
            return openai_error(503, f"The replica serving this request was lost ({type(err).__name__}) after it "
                                "had taken it; the request was not rerun. Retry it.",
                                retry_after_s=self.limits.retry_after_s)
        except (_Retry, BackPressureError, DeploymentUnavailableError):
            raise
        except Exception as err:  # the replica failed in a way vLLM's app did not answer
            log.exception("model %s: request failed on replica %s", self.name, replica)
            return openai_error(500, f"Model {self.name} failed to answer ({type(err).__name__}).")
        rewritten = as_openai_error(start.status, content_type, body)
        if rewritten is not None:
            body, headers["content-type"] = rewritten, "application/json"
        return Response(body, status_code=start.status, headers=headers)

    async def _relay(self, first: bytes, stream) -> AsyncIterator[bytes]:
        """The stream after its first chunk, ended with an error event and ``[DONE]`` if it breaks."""
        try:
            yield first
            while True:
                try:
                    async with asyncio.timeout_at(self.deadline):
                        chunk = await stream.__anext__()
                except StopAsyncIteration:
                    return
                yield chunk
        except TimeoutError:
            yield sse_error(504, "The stream did not complete within its deadline; it was cancelled.")
        except REPLICA_LOST as err:
            yield sse_error(503, f"The replica serving this stream was lost ({type(err).__name__}). Retry it.")
        except Exception as err:
            log.exception("model %s: stream failed", self.name)
            yield sse_error(500, f"The stream failed ({type(err).__name__}).")
        finally:
            stream.cancel()  # a client that went away, or a deadline, stops the generation on the replica
