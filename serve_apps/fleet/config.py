"""Typed configs of the fleet simulator: the traffic (a trace file and how to scale it, or a
synthetic workload) and one fleet run (profile, variant, autoscaling and routing exactly as in a
serve config, SLO). Every field is documented; unknown keys are errors."""

from __future__ import annotations

from pydantic import Field, model_validator

from serve_apps.config import AutoscalingOptions, RoutingOptions
from serve_apps.fleet.synthetic import SyntheticConfig, generate
from serve_apps.fleet.trace import Trace, scale_lengths, stretch, superpose, window
from serve_apps.fleet.trace_files import read_trace
from swiftkv.yaml_config import StrictConfig


class LengthScaling(StrictConfig):
    """Shrink a trace's prompts block by block, for replicas that cannot run its real lengths."""

    block_tokens: int = Field(gt=0)
    """Tokens per prefix block after scaling (the trace's 512 to this: every prompt scales by the same
    factor and keeps its block structure)."""

    max_input_tokens: int = Field(gt=0)
    """Prompts are cut to at most this many tokens (whole blocks)."""

    max_output_tokens: int = Field(gt=0)
    """Outputs are capped at this many tokens."""


class TrafficConfig(StrictConfig):
    """Where requests come from and how the trace is cut and scaled (applied in the order below)."""

    trace: str | None = None
    """A trace file, Mooncake (JSON lines: ``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids``) or Azure (CSV: ``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``); the three
    shipped are in ``serve_apps/fleet/traces/``."""

    synthetic: SyntheticConfig | None = None
    """A generated workload instead of a trace file."""

    start_s: float = Field(default=0.0, ge=0)
    """Skip the trace's requests before this time."""

    duration_s: float | None = Field(default=None, gt=0)
    """Keep this many seconds of traffic from ``start_s`` (all of it if unset)."""

    limit: int | None = Field(default=None, gt=0)
    """Keep at most this many requests."""

    copies: int = Field(default=1, ge=1)
    """Superpose this many copies of the traffic (independent users: own prefix blocks, shifted in
    time): ``copies`` times the arrival rate with the trace's shape."""

    time_factor: float = Field(default=1.0, gt=0)
    """Multiply arrival times by this (2: half the rate, over twice the time)."""

    lengths: LengthScaling | None = None
    """Shrink prompt and output lengths (for CPU replicas)."""

    @model_validator(mode="after")
    def _one_source(self) -> TrafficConfig:
        if (self.trace is None) == (self.synthetic is None):
            raise ValueError("give exactly one of trace (a file) and synthetic (a generated workload)")
        return self

    def build(self) -> Trace:
        """The requests, read or generated, then cut and scaled as configured."""
        trace = read_trace(self.trace) if self.trace is not None else generate(self.synthetic)
        if self.start_s or self.duration_s is not None or self.limit is not None:
            trace = window(trace, self.start_s, self.duration_s, self.limit)
        if self.copies > 1:
            trace = superpose(trace, self.copies)
        if self.time_factor != 1.0:
            trace = stretch(trace, self.time_factor)
        if self.lengths is not None:
            trace = scale_lengths(trace, self.lengths.block_tokens, self.lengths.max_input_tokens,
                                  self.lengths.max_output_tokens)
        return trace


class FleetSettings(StrictConfig):
    """How a fleet is run, whatever model it serves: autoscaling and routing as a Serve deployment of
    ours would have them, and what is measured."""

    autoscaling: AutoscalingOptions = AutoscalingOptions(min_replicas=1, max_replicas=512)
    """The deployment's autoscaling (``policy: prefill`` ours, ``requests`` Serve's default), exactly
    the serve config's keys; ``initial_replicas`` replicas are ready at the start."""

    routing: RoutingOptions = RoutingOptions()
    """The deployment's routing (``router: prefill`` ours, ``pow2`` Serve's default), the serve
    config's keys."""

    max_ongoing_requests: int = Field(default=64, gt=0)
    """Requests one replica accepts at once (more wait at the router), as in the serve config."""

    capacity_input_tokens: int | None = Field(default=None, gt=0)
    """The serve config's ``prefill_tokens_per_s`` (what replicas publish and the policy and router
    use) read off the profile's curve at this prompt length, as ``swiftkv calibrate --input-lens``
    would measure it (default: the profile's own figure)."""

    startup_s: float | None = Field(default=None, ge=0)
    """Seconds for a new replica to come up (default: the profile's)."""

    ingress_s: float = Field(default=0.0, ge=0)
    """Seconds the endpoint's front end (HTTP proxy, ingress, routing) spends on each request, one
    request at a time: a burst reaches the replicas spread out, not at one instant. 0 where the front
    end has cores of its own (a GPU fleet); ``swiftkv fleet validate`` measures it on a shared host."""

    ingress_latency_s: float = Field(default=0.0, ge=0)
    """Seconds every request spends on its way through the front end and back beyond ``ingress_s``,
    in parallel with other requests (TTFTs count from arrival, so it adds to each)."""

    shared_host_slowdown: float = Field(default=1.0, ge=1.0)
    """Where the replicas share their host's cores with the endpoint's own processes (the front end,
    the replicas' Serve actors, a load client: the validation's 2-core machine), those take CPU from
    the engines once no core is idle: a step started while every replica is busy (the replicas filling
    the host's cores) takes this many times as long as the profile says. 1 where the serving stack
    has CPUs of its own (a GPU fleet); ``swiftkv fleet validate`` measures it on a shared host."""

    control_interval_s: float = Field(default=1.0, gt=0)
    """How often the autoscaling policy runs (Serve: every 0.1 s; its delays are in seconds, so a
    coarser tick changes little and runs faster)."""

    slo_ttft_s: float = Field(default=2.0, gt=0)
    """A request meets the SLO when its time to first token is at most this."""

    score_from_s: float = Field(default=0.0, ge=0)
    """Requests arriving before this are not scored (latency percentiles, SLO attainment, goodput),
    for every fleet alike; replica-hours count from the start. An autoscaled fleet starts cold at
    ``autoscaling.min_replicas`` while the trace starts at full rate: this is the time it is given to
    come up (the replica-hours it spends meanwhile are counted)."""

    timeline_period_s: float = Field(default=10.0, gt=0)
    """Resolution of the replicas/TTFT timeline."""

    tail_limit_s: float = Field(default=1800.0, gt=0)
    """Requests not finished this long after the last arrival count as failed."""

    idle_tail_s: float = Field(default=0.0, ge=0)
    """Go on simulating this long after the last request finished (its replicas counted meanwhile),
    so that an autoscaled fleet's scale-down afterwards is followed (the validation compares it)."""

    seed: int = 0
    """Seed of the power-of-two router's random choices."""


class FleetConfig(FleetSettings):
    """One simulated fleet: a model variant on replicas of a profile."""

    model: str
    """The variant of the profile the replicas run (a key of its ``models``)."""

    static_replicas: int | None = Field(default=None, gt=0)
    """A static fleet of this many replicas, all ready from the start (no autoscaling)."""


class SimulateConfig(StrictConfig):
    """``swiftkv fleet simulate``: one fleet replaying some traffic."""

    traffic: TrafficConfig
    """The requests."""

    profile: str
    """A profile file (``swiftkv calibrate`` output, or ``serve_apps/fleet/profiles/*.yaml``)."""

    fleet: FleetConfig
    """The fleet."""

    out: str = "artifacts/fleet/simulate"
    """Folder (or fsspec URI) for ``results.json`` and ``timeline.png``."""


class EngineCalibration(StrictConfig):
    """The points of a replica's timing curves: what ``swiftkv fleet validate`` has ``swiftkv
    calibrate`` measure of the served variant (its replicas side by side) just before the replay."""

    input_lens: list[int] = Field(default=[128, 512, 1536], min_length=1)
    """Prompt lengths of the prefill points (the longest gives ``prefill_tokens_per_s``)."""

    batches: list[int] = Field(default=[1, 4], min_length=1)
    """Sequences per replica of the decode points."""

    decode_contexts: list[int] = Field(default=[128, 1024], min_length=1)
    """Context lengths of the decode points at the largest batch."""

    num_prompts: int = Field(default=2, gt=0)
    """Prompts per replica in each prefill point."""

    rounds: int = Field(default=2, gt=0)
    """Repetitions of each point (medians kept)."""


class ServeCalibration(EngineCalibration):
    """What ``swiftkv fleet calibrate-serve`` measures through a validation's endpoint: the same
    points, more of them, and how a decode point is timed there."""

    input_lens: list[int] = Field(default=[32, 128, 512, 1536], min_length=1)
    """Prompt lengths of the prefill points (the longest gives ``prefill_tokens_per_s``)."""

    batches: list[int] = Field(default=[1, 4, 8], min_length=1)
    """Sequences per replica of the decode points (``decode_context_tokens`` of context each)."""

    decode_context_tokens: int = Field(default=128, gt=0)
    """Context of the by-batch decode points."""

    decode_tokens: int = Field(default=16, gt=0)
    """Extra output tokens timed for a decode point."""


class FrontEndCalibration(StrictConfig):
    """How ``swiftkv fleet validate`` measures the endpoint's front end (``ingress_s`` and
    ``ingress_latency_s``) before the replay."""

    lone_prompt_tokens: int = Field(default=16, gt=0)
    """Prompt length of the lone requests (their TTFT minus the engine's time is the front end's)."""

    pair_prompt_tokens: int = Field(default=256, gt=0)
    """Prompt length of the requests sent together, one per idle replica (how much later each next
    one reaches its replica is the front end's time per request)."""

    rounds: int = Field(default=5, gt=0)
    """Lone requests and bursts each (medians kept)."""

    pause_s: float = Field(default=3.0, ge=0)
    """Wait between bursts: our router counts what it sent a replica until that replica's figures
    show it (they come every ``routing.stats_period_s``), and back to back it would still see the last
    burst and put both prompts of the next on one replica."""


class ValidateMeasurement(StrictConfig):
    """The simulator's inputs measured on this machine right before the replay."""

    engine: EngineCalibration = EngineCalibration()
    """The engine profile."""

    front_end: FrontEndCalibration = FrontEndCalibration()
    """The front end's time per request."""
