"""One model replica: vLLM's ``AsyncLLM`` (with the swiftkv plugin) and vLLM's own OpenAI app around
it, served through Ray Serve.

The ingress forwards each HTTP request here as data (:class:`~serve_apps.asgi.ForwardedRequest`);
the replica runs it through vLLM's FastAPI app in-process, so routes, request validation and error
bodies are exactly vLLM's server's. Beside serving, the replica publishes its prefill load
(:class:`~serve_apps.load.ReplicaLoad`) to Serve's autoscaler and to the routers, and as Prometheus
gauges; vLLM's own engine metrics go to Ray's metrics endpoint through vLLM's Ray stat logger.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator

from ray import serve

from serve_apps.asgi import Accepted, ForwardedRequest, ResponseStart, call_asgi
from serve_apps.config import ModelOptions
from serve_apps.errors import error_body
from serve_apps.load import LoadTracker, ReplicaLoad
from serve_apps.vllm_app import check_admission, served_engine_config, start_openai_app

log = logging.getLogger("ray.serve")

REPLICA_HEADER = "x-swiftkv-replica"
"""Response header naming the replica that served the request."""

PUBLISH_PERIOD_S = 1.0


@serve.deployment
class ModelServer:
    """The Serve deployment class behind every model (``serve_apps.app`` names one per model)."""

    async def __init__(self, options: ModelOptions) -> None:
        from ray.util.metrics import Gauge
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        from serve_apps.engine_stats import load_logger_factory
        from swiftkv.model_source import resolve_model

        self.options = options
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        path = await asyncio.to_thread(resolve_model, options.model)
        log.info("model %s: starting vLLM on %s", options.name, path)
        args, vllm_config = served_engine_config(options, path)
        check_admission(options, vllm_config)
        self.tracker = LoadTracker(options.prefill_tokens_per_s)
        self.engine = AsyncLLM.from_vllm_config(
            vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            stat_loggers=[load_logger_factory(self.tracker), RayPrometheusStatLogger],
            enable_log_requests=args.enable_log_requests,
            disable_log_stats=args.disable_log_stats,
        )
        self.app, self._lifespan = await start_openai_app(self.engine, args)

        tags = {"model": options.name, "replica": self.replica_id}
        self._gauges = {
            name: Gauge(f"swiftkv_{metric}", description=text, tag_keys=("model", "replica")).set_default_tags(tags)
            for name, metric, text in (
                ("prompt_tokens_waiting", "prompt_tokens_waiting",
                 "Prompt tokens of requests waiting for or in prefill."),
                ("prompt_tokens_per_s", "prompt_tokens_per_second", "Prompt tokens arriving per second."),
                ("uncached_prompt_tokens_per_s", "uncached_prompt_tokens_per_second",
                 "Prompt tokens computed (prefix-cache misses) per second."),
                ("kv_cache_usage", "kv_cache_usage", "Fraction of KV-cache blocks in use."),
                ("ttft_p90_s", "ttft_p90_seconds", "Recent 90th percentile time to first token."),
            )
        }
        self._publisher = asyncio.create_task(self._publish_forever())
        log.info("model %s: replica %s ready (%s)", options.name, self.replica_id, path)

    def load(self) -> ReplicaLoad:
        """This replica's prefill load now."""
        return self.tracker.snapshot(time.time(), float(self.engine.get_num_queued_tokens()))

    async def _publish_forever(self) -> None:
        while True:
            load = self.load()
            for name, gauge in self._gauges.items():
                gauge.set(getattr(load, name))
            await asyncio.sleep(PUBLISH_PERIOD_S)

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.load().to_metrics()

    def record_routing_stats(self) -> dict[str, float]:
        return self.load().to_metrics()

    async def check_health(self) -> None:
        """Serve's health check: the engine must be alive and making progress, a step finished within
        ``health_probe_timeout_s`` or else one token produced within it (an engine that hangs still
        reports no error). Three failures in a row make Serve replace this replica."""
        from vllm import SamplingParams

        await self.engine.check_health()  # a dead engine raises at once
        # A busy engine is alive: a probe would wait behind its queue (vLLM schedules in order) and
        # fail a healthy replica under load (the fleet validation's warm-up burst did, on CPU).
        last_step = self.tracker.last_step_monotonic
        if last_step is not None and time.monotonic() - last_step < self.options.health_probe_timeout_s:
            return
        request_id = f"health-{uuid.uuid4().hex}"
        try:
            async with asyncio.timeout(self.options.health_probe_timeout_s):
                async for _ in self.engine.generate({"prompt_token_ids": [0]}, SamplingParams(max_tokens=1),
                                                    request_id):
                    pass
        except TimeoutError:
            raise TimeoutError(f"model {self.options.name}: the engine produced no token within "
                               f"{self.options.health_probe_timeout_s:g} s") from None

    def _dead_engine(self) -> list[ResponseStart | bytes]:
        body = json.dumps(error_body(503, f"The engine of replica {self.replica_id} of model {self.options.name} "
                                          "has stopped; it is being replaced. Retry shortly.")).encode()
        headers = [("content-type", "application/json"), ("retry-after", str(math.ceil(self.options.retry_after_s))),
                   (REPLICA_HEADER, self.replica_id)]
        return [ResponseStart(503, headers), body]

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[Accepted | ResponseStart | bytes]:
        """Serve ``request`` with vLLM's app; stream its response back to the ingress, after an
        :class:`Accepted`. A dead engine is a 503 (vLLM's own answer is a 500)."""
        yield Accepted(self.replica_id)
        if self.engine.errored:
            for item in self._dead_engine():
                yield item
            return
        response = call_asgi(self.app, request)
        try:
            async for item in response:
                if isinstance(item, ResponseStart):
                    if item.status == 500 and self.engine.errored:
                        for dead in self._dead_engine():
                            yield dead
                        return
                    item.headers.append((REPLICA_HEADER, self.replica_id))
                yield item
        finally:
            await response.aclose()

    def __del__(self) -> None:
        # Serve calls this after draining in-flight requests: stop publishing and shut the engine
        # (its engine-core and worker processes) down.
        for stop in (lambda: self._publisher.cancel(), lambda: self.engine.shutdown()):
            with contextlib.suppress(Exception):
                stop()
