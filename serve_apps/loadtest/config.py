"""The load test's typed config (``ray_jobs/configs/loadtest-*.yaml``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from swiftkv.yaml_config import StrictConfig

Scenario = Literal["swiftkv_vs_base", "serve_overhead", "router", "autoscaling"]


class LoadTestConfig(StrictConfig):
    """Which comparisons to run, on which models, with how much traffic. Every comparison runs its
    variants side by side: interleaved round by round, fresh prompts each round, prefix caching off."""

    scenarios: list[Scenario] = ["swiftkv_vs_base", "serve_overhead", "router", "autoscaling"]
    """``swiftkv_vs_base``: base vs SwiftKV deployments on prefill-heavy traffic; ``serve_overhead``:
    the SwiftKV model through Serve vs vLLM's own OpenAI server alone; ``router``: the prefill-aware
    router vs Serve's power-of-two router on a mix of long and short prompts over two replicas;
    ``autoscaling``: the prefill-aware policy vs Serve's request-count policy on a burst of long prompts."""

    base_model: str = "bundled"
    """The base model (any model reference)."""

    swiftkv_model: str = "bundled-swiftkv"
    """Its SwiftKV version (speed does not depend on distillation: the conversion's weights will do)."""

    base_prefill_tokens_per_s: float = Field(default=300.0, gt=0)
    """The base model's calibrated prefill rate per replica (``swiftkv calibrate``)."""

    swiftkv_prefill_tokens_per_s: float = Field(default=490.0, gt=0)
    """The SwiftKV model's calibrated prefill rate per replica."""

    engine_kwargs: dict[str, Any] = {"dtype": "float32", "enforce_eager": True, "max_model_len": 4096,
                                     "enable_prefix_caching": False}
    """vLLM options of every replica (and of the standalone vLLM server)."""

    env: dict[str, str] = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    """Environment of every replica (and of the standalone vLLM server)."""

    num_cpus: float = Field(default=1.0, ge=0)
    """Logical CPUs per replica."""

    num_gpus: float = Field(default=0.0, ge=0)
    """GPUs per replica."""

    rounds: int = Field(default=2, gt=0)
    """Interleaved repetitions of every comparison (medians of per-round ratios reported)."""

    request_timeout_s: float = Field(default=600.0, gt=0)
    """No request may take longer; each run is also bounded by its request count."""

    heavy_requests: int = Field(default=24, gt=0)
    """Prefill-heavy traffic: requests per run (``swiftkv_vs_base``, ``serve_overhead``)."""

    heavy_input_len: int = Field(default=2000, gt=0)
    """Prefill-heavy traffic: prompt tokens."""

    heavy_output_len: int = Field(default=16, gt=0)
    """Prefill-heavy traffic: output tokens."""

    heavy_concurrency: int = Field(default=8, gt=0)
    """Prefill-heavy traffic: requests in flight at once (a closed loop: throughput is the figure)."""

    mix_requests: int = Field(default=60, gt=1)
    """Long/short mix: requests per run (``router``)."""

    mix_long_share: float = Field(default=0.25, gt=0, lt=1)
    """Long/short mix: share of long prompts."""

    mix_long_len: int = Field(default=3000, gt=0)
    """Long/short mix: tokens of a long prompt."""

    mix_long_output_len: int = Field(default=16, gt=0)
    """Long/short mix: output tokens of a long prompt (prefill-heavy: a document to summarise)."""

    mix_short_len: int = Field(default=64, gt=0)
    """Long/short mix: tokens of a short prompt."""

    mix_short_output_len: int = Field(default=128, gt=0)
    """Long/short mix: output tokens of a short prompt (a chat turn that decodes for a while: it keeps
    a replica's request count up while its prefill queue is empty, where counting requests misleads)."""

    mix_rate: float = Field(default=1.0, gt=0)
    """Long/short mix: Poisson arrival rate (requests/s)."""

    router_replicas: int = Field(default=2, gt=0)
    """Replicas of each router's deployment (``router``); a router has a choice only from two up."""

    burst_requests: int = Field(default=8, gt=0)
    """Burst: long prompts sent at once (``autoscaling``)."""

    burst_input_len: int = Field(default=2000, gt=0)
    """Burst: prompt tokens."""

    burst_output_len: int = Field(default=16, gt=0)
    """Burst: output tokens."""

    burst_window_s: float = Field(default=120.0, gt=0)
    """Burst: seconds from the burst's start over which replica-seconds are counted."""

    ttft_budget_s: float = Field(default=3.0, gt=0)
    """Burst: the prefill-aware policy's TTFT budget (and the bar TTFT p95 is checked against)."""

    requests_target: float = Field(default=8.0, gt=0)
    """Burst: the request-count policy's ``target_ongoing_requests`` (what one replica batches)."""

    port: int = Field(default=8000, gt=0)
    """Serve's HTTP port on 127.0.0.1 (the load is sent over loopback only)."""

    vllm_port: int = Field(default=8100, gt=0)
    """The standalone vLLM server's port on 127.0.0.1 (``serve_overhead``)."""

    seed: int = 0
    """Prompts are random token ids from this seed, distinct for every run."""

    out: str = "artifacts/loadtest"
    """Folder or ``s3://`` prefix for ``results.json``, ``report.md`` and ``loadtest.png``."""
