"""The Serve application builder: ``import_path: serve_apps.app:build_app`` in a Serve config file.

    serve run serve_apps/smollm2-cpu.yaml        # or: serve deploy, or swiftkv serve --config ...

One ``OpenAIIngress`` deployment routes by the request's ``model`` field to one ``ModelServer``
deployment per configured model; each model deployment carries its autoscaling policy and request
router, built here from the typed config (``serve_apps/config.py``).
"""

from __future__ import annotations

import re
from typing import Any

from ray.serve import Application

from serve_apps.config import AppConfig, ModelOptions
from serve_apps.ingress import OpenAIIngress
from serve_apps.model_server import ModelServer
from swiftkv.yaml_config import parse_config

HEALTH_CHECK_MARGIN_S = 5.0
INGRESS_SPARE_REQUESTS = 256


def deployment_name(model_name: str) -> str:
    """The Serve deployment of a model (Serve names allow no slashes)."""
    return "model-" + re.sub(r"[^A-Za-z0-9._-]", "-", model_name)


def autoscaling_config(options: ModelOptions) -> dict[str, Any]:
    """Serve's ``autoscaling_config`` for a model deployment."""
    scaling = options.autoscaling
    config: dict[str, Any] = {
        "min_replicas": scaling.min_replicas,
        "max_replicas": scaling.max_replicas,
        "initial_replicas": scaling.initial_replicas,
        "upscale_delay_s": scaling.upscale_delay_s,
        "downscale_delay_s": scaling.downscale_delay_s,
        "look_back_period_s": scaling.look_back_period_s,
        "metrics_interval_s": scaling.metrics_interval_s,
    }
    if scaling.policy == "requests":
        config["target_ongoing_requests"] = scaling.target_ongoing_requests
    else:
        config["downscaling_factor"] = scaling.downscaling_factor
        config["policy"] = {
            "policy_function": "serve_apps.policy:PrefillAutoscalingPolicy",
            "policy_kwargs": {
                "prefill_tokens_per_s": options.prefill_tokens_per_s,
                "ttft_budget_s": scaling.ttft_budget_s,
                "target_utilization": scaling.target_utilization,
                "downscale_utilization": scaling.downscale_utilization,
                "kv_cache_high": scaling.kv_cache_high,
                "kv_cache_low": scaling.kv_cache_low,
                "max_ongoing_requests": options.max_ongoing_requests,
                "replica_startup_s": scaling.replica_startup_s,
            },
        }
    return config


def request_router_config(options: ModelOptions) -> dict[str, Any]:
    """Serve's ``request_router_config`` for a model deployment."""
    routing = options.routing
    config: dict[str, Any] = {"request_routing_stats_period_s": routing.stats_period_s}
    if routing.router == "prefill":
        config["request_router_class"] = "serve_apps.router:PrefillAwareRouter"
        config["request_router_kwargs"] = {
            "prefill_tokens_per_s": options.prefill_tokens_per_s,
            "prefix_margin_s": routing.prefix_margin_s,
        }
    return config


def deployment_options(options: ModelOptions) -> dict[str, Any]:
    """Serve's deployment options for one model."""
    actor_options: dict[str, Any] = {"num_cpus": options.num_cpus, "num_gpus": options.num_gpus}
    if options.env:
        actor_options["runtime_env"] = {"env_vars": dict(options.env)}
    return {
        "name": deployment_name(options.name),
        "ray_actor_options": actor_options,
        "max_ongoing_requests": options.max_ongoing_requests,
        "max_queued_requests": options.max_queued_requests,
        "backpressure_config": {"status_code": options.backpressure_status, "retry_after_s": options.retry_after_s},
        "max_replicas_per_node": options.max_replicas_per_node,
        "graceful_shutdown_timeout_s": options.graceful_shutdown_timeout_s,
        "autoscaling_config": autoscaling_config(options),
        "request_router_config": request_router_config(options),
        "health_check_period_s": options.health_check_period_s,
        # The check's own deadline is the probe's; Serve's must not cut it short.
        "health_check_timeout_s": options.health_probe_timeout_s + HEALTH_CHECK_MARGIN_S,
        # A replica that cannot start (a bad path, an engine option vLLM rejects) fails the same way
        # each time: report it after a retry instead of Serve's default 20 attempts.
        "max_constructor_retry_count": 2,
    }


def ingress_capacity(config: AppConfig) -> int:
    """Requests one ingress replica holds at most: for each model, every replica full and the
    ingress's queue for it full, plus room for the requests it answers itself (refusals, health)."""
    return sum(m.max_ongoing_requests * m.autoscaling.max_replicas + m.max_queued_requests
               for m in config.models) + INGRESS_SPARE_REQUESTS


def build_app(args: dict[str, Any]) -> Application:
    """Build the application from a Serve config's ``args`` (validated as :class:`AppConfig`)."""
    config = args if isinstance(args, AppConfig) else parse_config(AppConfig, dict(args), what="serve_apps config")
    models = {m.name: ModelServer.options(**deployment_options(m)).bind(m) for m in config.models}
    # The ingress relays every stream: it must drain at least as long as the slowest model does.
    drain_s = max(m.graceful_shutdown_timeout_s for m in config.models) + 5
    # Queues are bounded at the models (max_queued_requests, refused in OpenAI's format); the ingress
    # takes everything the models can hold, so Serve's proxy never queues in front of it.
    capacity = ingress_capacity(config)
    return OpenAIIngress.options(num_replicas=config.ingress_replicas, graceful_shutdown_timeout_s=drain_s,
                                 max_ongoing_requests=capacity, max_queued_requests=capacity,
                                 ray_actor_options={"num_cpus": config.ingress_num_cpus}).bind(config, models)
