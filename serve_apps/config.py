"""The Serve application's typed config: the ``args`` of ``serve_apps.app:build_app`` in a Serve
config file (``serve run serve_apps/smollm2-cpu.yaml``), and what ``swiftkv serve --config`` reads.

Every field has a docstring; unknown keys are errors that name the key.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from swiftkv.yaml_config import StrictConfig

# Engine options the application owns or refuses: the app sets the first two itself, authentication
# is the ingress's job (one key for every route), and checkpoints never run their own code.
RESERVED_ENGINE_KWARGS = {
    "model": "set `model` on the model entry instead",
    "served_model_name": "set `name` on the model entry instead",
    "api_key": "set the application's api_key_env / api_key_file instead (the ingress checks the key)",
    "trust_remote_code": "SwiftKV checkpoints load without remote code; it stays off",
    "host": "the replica serves through Ray Serve, not its own socket",
    "port": "the replica serves through Ray Serve, not its own socket",
}


class AutoscalingOptions(StrictConfig):
    """How many replicas of one model deployment run, and what decides."""

    min_replicas: int = Field(default=1, ge=0)
    """Fewest replicas. 0 scales to zero when the model is idle; the first request then waits for a
    replica to start (Serve's cold start: a minute or more), so the application's ``queue_timeout_s``
    must cover a start."""

    max_replicas: int = Field(default=1, ge=1)
    """Most replicas."""

    initial_replicas: int | None = Field(default=None, ge=0)
    """Replicas at deploy time (default: ``min_replicas``)."""

    policy: Literal["prefill", "requests"] = "prefill"
    """``prefill``: swiftkv's prefill-aware policy (``serve_apps/policy.py``); ``requests``: Ray Serve's
    own policy on ongoing requests per replica (``target_ongoing_requests``)."""

    ttft_budget_s: float = Field(default=2.0, gt=0)
    """``prefill``: the waiting prompt tokens must clear within this many seconds."""

    target_utilization: float = Field(default=0.8, gt=0, le=1)
    """``prefill``: scale up when prompt tokens arrive faster than this share of the fleet's capacity."""

    downscale_utilization: float = Field(default=0.5, gt=0, le=1)
    """``prefill``: scale down only to a count that runs below this share (hysteresis)."""

    kv_cache_high: float = Field(default=0.9, gt=0, le=1)
    """``prefill``: add a replica when mean KV-cache usage reaches this or any replica preempts."""

    kv_cache_low: float = Field(default=0.6, gt=0, le=1)
    """``prefill``: scale down only if the projected KV-cache usage stays at or below this."""

    replica_startup_s: float = Field(default=0.0, ge=0)
    """``prefill``: seconds a new replica takes to serve (``swiftkv fleet validate`` measures it, asked
    for to serving); the backlog the running replicas clear within it asks for no new replica. 0: every
    backlog over ``ttft_budget_s`` asks for replicas, as if they started at once."""

    downscaling_factor: float = Field(default=0.5, gt=0, le=1)
    """``prefill``: Serve's ``downscaling_factor``: a scale-down goes this share of the way to the
    policy's count (one replica at least). Requests admitted in a burst hold little KV at first and
    grow as they decode, so the count a scale-down sees right after a burst is too low."""

    target_ongoing_requests: float = Field(default=2.0, gt=0)
    """``requests``: ongoing requests per replica Serve aims for."""

    upscale_delay_s: float = Field(default=1.0, ge=0)
    """A scale-up decision must hold this long before Serve acts on it."""

    downscale_delay_s: float = Field(default=60.0, ge=0)
    """A scale-down decision must hold this long before Serve acts on it: longer than a typical
    reply takes, so that the KV cache of requests admitted in a burst has grown before the count is
    trusted (with 20 s a fleet serving 2K-token replies scaled down into preemptions and missed its
    SLO)."""

    look_back_period_s: float = Field(default=3.0, gt=0)
    """Serve averages the replicas' published figures over this window."""

    metrics_interval_s: float = Field(default=1.0, gt=0)
    """How often replicas push their figures to Serve's controller (Serve's default, 10 s, is too
    slow for prefill bursts)."""

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingOptions:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must lie between min_replicas and max_replicas")
        if self.downscale_utilization >= self.target_utilization:
            raise ValueError("downscale_utilization must be below target_utilization")
        if self.kv_cache_low >= self.kv_cache_high:
            raise ValueError("kv_cache_low must be below kv_cache_high")
        return self


class RoutingOptions(StrictConfig):
    """How the ingress picks a replica of a model for each request."""

    router: Literal["prefill", "pow2"] = "prefill"
    """``prefill``: lowest estimated time to first token, prefix-cache aware (``serve_apps/router.py``);
    ``pow2``: Ray Serve's default power-of-two-choices router on queue length."""

    prefix_margin_s: float = Field(default=1.0, ge=0)
    """``prefill``: keep a prompt on the replica holding its prefix until that replica's estimated
    TTFT is this much worse than the best other replica's (or, if less, the prefill time the cached
    prefix saves)."""

    stats_period_s: float = Field(default=1.0, gt=0)
    """How often replicas report their load to the routers."""


class ModelOptions(StrictConfig):
    """One served model: a Serve deployment whose replicas each run a vLLM engine."""

    name: str
    """The name clients put in the request's ``model`` field (and ``/v1/models`` lists)."""

    model: str
    """Model reference: a local folder, ``bundled`` (SmolLM2-135M-Instruct), an ``s3://`` folder
    (copied once per node) or a hub id. SwiftKV checkpoints and plain base models both work."""

    engine_kwargs: dict[str, Any] = {}
    """vLLM engine and server options, as ``vllm serve`` flags in snake_case (``max_model_len``,
    ``dtype``, ``tensor_parallel_size``, ``kv_cache_dtype``, ``enable_prefix_caching``, ...)."""

    prefill_skipping: bool = True
    """SwiftKV checkpoints: skip layers >= c for prompt tokens (prompt logprobs are then refused
    with a 400). Off: same outputs at the base model's prefill cost. No effect on base models."""

    prefill_tokens_per_s: float = Field(default=1000.0, gt=0)
    """One replica's prefill rate in uncached prompt tokens/s, measured on the replica's hardware with
    ``swiftkv calibrate`` (SwiftKV on). The autoscaler's and router's capacity figure."""

    num_cpus: float = Field(default=1.0, ge=0)
    """Logical CPUs each replica reserves."""

    num_gpus: float = Field(default=0.0, ge=0)
    """GPUs each replica reserves (``tensor_parallel_size`` of them for tensor parallelism)."""

    env: dict[str, str] = {}
    """Environment variables of each replica (e.g. ``VLLM_CPU_KVCACHE_SPACE``). Never put secrets here."""

    max_replicas_per_node: int | None = Field(default=None, gt=0)
    """At most this many replicas on one Ray node (Serve's own option; e.g. 1 spreads the replicas
    over the nodes, so losing a node loses one replica). ``None``: no limit."""

    max_ongoing_requests: int = Field(default=64, gt=0)
    """Requests one replica accepts at once (vLLM batches them); further ones queue at the ingress.
    Must be below the engine's ``max_num_seqs`` (vLLM's limit on sequences it runs at once), so vLLM
    admits every request it is sent at once and never holds a queue of its own, and the health
    check's one-token generation always finds a free seat."""

    max_queued_requests: int = Field(default=64, gt=0)
    """Requests each ingress replica holds for this model while every replica is at
    ``max_ongoing_requests`` (Serve's ``max_queued_requests``); further ones are refused at once
    with ``backpressure_status`` and a ``Retry-After`` header."""

    backpressure_status: Literal[429, 503] = 503
    """HTTP status of a request refused because the queue is full (Serve's ``backpressure_config``)."""

    retry_after_s: float = Field(default=1.0, ge=0)
    """``Retry-After`` of a refusal (queue full, no replica free in time, model unavailable)."""

    health_check_period_s: float = Field(default=10.0, gt=0)
    """How often Serve checks each replica's health: an engine that finished a step recently is
    alive; one that did not (idle, or hung) is asked for one token."""

    health_probe_timeout_s: float = Field(default=10.0, gt=0)
    """An engine with no step in this long that does not produce that token within it either fails
    the check; after three failed checks in a row Serve replaces the replica (a hung engine is
    restarted, a busy one is not)."""

    graceful_shutdown_timeout_s: float = Field(default=60.0, ge=0)
    """On shutdown or scale-down, in-flight requests get this long to finish."""

    autoscaling: AutoscalingOptions = AutoscalingOptions()
    """Replica count and the policy behind it."""

    routing: RoutingOptions = RoutingOptions()
    """Request routing among this model's replicas."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:/-]*", value):
            raise ValueError(f"model name {value!r}: use letters, digits and . _ : / -")
        return value

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if key in RESERVED_ENGINE_KWARGS:
                raise ValueError(f"engine_kwargs.{key}: {RESERVED_ENGINE_KWARGS[key]}")
        return value


class AppConfig(StrictConfig):
    """The whole application: an OpenAI-compatible ingress in front of one deployment per model."""

    models: list[ModelOptions] = Field(min_length=1)
    """The served models, routed by the request's ``model`` field (e.g. a base model and its SwiftKV
    version side by side for A/B traffic)."""

    api_key_env: str | None = "SWIFTKV_API_KEY"
    """Environment variable holding the API key (bearer token) every route but ``/health`` and
    ``/health/ready`` requires. Read on the node that runs the ingress."""

    api_key_file: str | None = None
    """File holding the API key (first line; ``~`` is the home folder of the node that runs the
    ingress), e.g. a mounted Kubernetes secret. Takes precedence over ``api_key_env``."""

    insecure_no_auth: bool = False
    """Serve every client without a key. Without a key and without this, the ingress answers only
    clients on its own host (loopback) and refuses every other with a 401, and ``swiftkv serve``
    refuses to bind anything but loopback. An error if a key is configured too."""

    request_timeout_s: float = Field(default=600.0, gt=0)
    """Deadline of a whole request, streams included. Past it the generation is cancelled in the
    engine (its KV cache freed) and the client gets a 504, or a stream an error event and
    ``[DONE]``. Serve's own ``http_options.request_timeout_s`` should be a little longer, as a
    backstop (``swiftkv serve`` sets it)."""

    queue_timeout_s: float = Field(default=30.0, gt=0)
    """Longest a request waits for a replica to accept it (all busy, or none running yet) before a
    503 with ``Retry-After``. At most ``request_timeout_s``."""

    max_body_bytes: int = Field(default=16 * 2**20, gt=0)
    """Largest request body accepted; bigger ones get a 413."""

    ingress_replicas: int = Field(default=1, gt=0)
    """Replicas of the ingress (light: JSON parsing and forwarding)."""

    ingress_num_cpus: float = Field(default=0.5, ge=0)
    """Logical CPUs each ingress replica reserves."""

    @model_validator(mode="after")
    def _checks(self) -> AppConfig:
        names = [m.name for m in self.models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model names must be unique: {', '.join(duplicates)} appears more than once")
        if self.queue_timeout_s > self.request_timeout_s:
            raise ValueError(f"queue_timeout_s ({self.queue_timeout_s:g}) exceeds request_timeout_s "
                             f"({self.request_timeout_s:g})")
        return self
