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
import difflib
import logging
import time
from argparse import Namespace
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from ray import serve

from serve_apps.asgi import ForwardedRequest, ResponseStart, call_asgi
from serve_apps.config import ModelOptions
from serve_apps.load import LoadTracker, ReplicaLoad

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("ray.serve")

REPLICA_HEADER = "x-swiftkv-replica"
"""Response header naming the replica that served the request."""

PUBLISH_PERIOD_S = 1.0


def vllm_server_args(options: ModelOptions, model_path: str) -> Namespace:
    """vLLM's own ``vllm serve`` arguments for this model: its parser's defaults, then the model,
    its served name and ``engine_kwargs`` (each key checked against vLLM's option names)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", model_path, "--served-model-name", options.name]
    )
    known = vars(args)
    for key, value in options.engine_kwargs.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"model {options.name!r}: engine_kwargs.{key} is not a vLLM option{hint}")
        setattr(args, key, value)
    extra = dict(args.additional_config or {})
    extra["swiftkv"] = {**extra.get("swiftkv", {}), "prefill_skipping": options.prefill_skipping}
    args.additional_config = extra
    validate_parsed_serve_args(args)
    return args


def served_engine_config(options: ModelOptions, model_path: str) -> tuple[Namespace, VllmConfig]:
    """The ``vllm serve`` arguments and the engine config a replica runs with: vLLM's server
    defaults, which differ from its offline ``LLM`` class's (on CPU 2,048 tokens per step and 128
    sequences instead of 4,096 and 256)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    args = vllm_server_args(options, model_path)
    return args, AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


@serve.deployment
class ModelServer:
    """The Serve deployment class behind every model (``serve_apps.app`` names one per model)."""

    async def __init__(self, options: ModelOptions) -> None:
        from ray.util.metrics import Gauge
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
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
        self.tracker = LoadTracker(options.prefill_tokens_per_s)
        self.engine = AsyncLLM.from_vllm_config(
            vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            stat_loggers=[load_logger_factory(self.tracker), RayPrometheusStatLogger],
            enable_log_requests=args.enable_log_requests,
            disable_log_stats=args.disable_log_stats,
        )
        tasks = await self.engine.get_supported_tasks()
        self.app = build_app(args, tasks, self.engine.model_config)
        await init_app_state(self.engine, self.app.state, args, tasks)
        # vLLM's lifespan: its periodic engine log lines ("Avg prompt throughput ..."). Held for the
        # replica's life: the context's exit deletes the app's state.
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()

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
        """Serve's health check: a dead engine makes Serve replace this replica."""
        await self.engine.check_health()

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Serve ``request`` with vLLM's app; stream its response back to the ingress."""
        async for item in call_asgi(self.app, request):
            if isinstance(item, ResponseStart):
                item.headers.append((REPLICA_HEADER, self.replica_id))
            yield item

    def __del__(self) -> None:
        # Serve calls this after draining in-flight requests: stop publishing and shut the engine
        # (its engine-core and worker processes) down.
        for stop in (lambda: self._publisher.cancel(), lambda: self.engine.shutdown()):
            with contextlib.suppress(Exception):
                stop()
