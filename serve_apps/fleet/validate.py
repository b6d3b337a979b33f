"""``swiftkv fleet validate``: the simulator against the real thing. The same trace slice is replayed
against a real ``swiftkv serve`` endpoint (fixed replicas, or autoscaled ones; started here and
stopped afterwards) and through the simulator; TTFT p50/p90 and throughput are compared, and for an
autoscaled fleet its replicas over time (Serve's own counts against the simulated ones).

What the simulator runs on is measured on this machine in the same command, just before the replay
(``measure``): the engine profile (``swiftkv calibrate``, the replicas side by side), the
endpoint's front end (:mod:`serve_apps.fleet.front_end`) and the shared-host slowdown (the cores the
engines had with none idle while calibrated over those they had serving the warm-up). On a shared
host the speed drifts by the hour (this machine: the same replay's TTFT p50 3.1-3.8 s one day, 1.9 s
the next), so figures from another hour would compare the simulator with another machine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, NamedTuple

import fsspec
from pydantic import Field, model_validator

from serve_apps.config import AutoscalingOptions
from serve_apps.fleet.config import FleetConfig, FleetSettings, ServeCalibration, TrafficConfig, ValidateMeasurement
from serve_apps.fleet.front_end import measure_front_end
from serve_apps.fleet.host_load import HostLoad
from serve_apps.fleet.plots import validation_png
from serve_apps.fleet.profile import Profile, ReplicaCosts, load_profile, profile_json
from serve_apps.fleet.replay import PASS_SALT, PROMPT_VOCAB, WARMUP_SALT, Burst, replay
from serve_apps.fleet.replica_watch import ReplicaWatch, replica_figures, startup_times
from serve_apps.fleet.results import summarize
from serve_apps.fleet.simulator import RunResult, simulate
from serve_apps.fleet.trace import Trace, shuffle_simultaneous, window
from serve_apps.load import percentile
from swiftkv.outputs import write_files
from swiftkv.yaml_config import StrictConfig, parse_config, read_yaml_mapping


class ValidateConfig(StrictConfig):
    """A validation run: one trace slice, a real endpoint and the simulator."""

    traffic: TrafficConfig
    """The slice (scaled so the real replicas keep up and its prompts fit the model)."""

    profile: str | None = None
    """A profile measured on this machine with the serve config's engine settings: the simulator's
    when ``measure`` is off, and the engine limits ``calibrate-serve`` keeps."""

    measure: ValidateMeasurement | None = ValidateMeasurement()
    """Measure the engine profile, the front end and the shared-host slowdown here, just before the
    replay, and simulate with them (written beside the validation as ``profile.json``); ``null``:
    simulate with ``profile`` and ``fleet`` as given."""

    model: str = "swiftkv-50"
    """The profile's variant the served model is."""

    serve_config: str = "serve_apps/fleet/configs/serve-smollm2-cpu-2-replicas.yaml"
    """The Serve config ``swiftkv serve`` runs (its first model is the one replayed against)."""

    replicas: int = Field(default=2, gt=0)
    """Replicas of the served model, fixed, in both (unless ``autoscaling``)."""

    autoscaling: AutoscalingOptions | None = None
    """Validate an autoscaled deployment instead: the real deployment and the simulated fleet run these
    options, every pass starting at ``min_replicas`` (the command waits for the real one to come back
    there), and the simulated replicas take the start-up time measured on the real ones in this run
    (Serve's replica asked for to serving; the profile's if none started)."""

    scale_down_timeout_s: float = Field(default=600.0, gt=0)
    """With ``autoscaling``: the most to wait for the real deployment to come back to
    ``min_replicas`` before each pass and after the last (the scale-down is compared too)."""

    fleet: FleetSettings = FleetSettings()
    """The simulated fleet's settings; its routing and ``max_ongoing_requests`` are also given to the
    real deployment, so both route alike."""

    port: int = Field(default=8040, gt=0)
    """The endpoint's port on 127.0.0.1."""

    metrics_port: int = Field(default=8041, gt=0)
    """Ray's metrics port of the served application."""

    replays: int = Field(default=1, gt=0)
    """Replay the slice this many times (each pass with its own token ids, so none finds another's
    prefix cache) and compare the simulator with the TTFTs and throughput of all passes pooled: on the
    2-core validation host one pass's p90 ranged 3.1-4.8 s within one run (each pass's figures are kept
    too)."""

    replay_pause_s: float = Field(default=5.0, ge=0)
    """Wait between passes, so each starts on idle replicas and a router whose figures show them idle
    (the simulation starts so)."""

    warmup_requests: int = Field(default=26, ge=0)
    """Untimed requests of the slice's first lengths and times, with other tokens, before the replay.
    26 covers the committed slice's first two bursts, its largest among them, so the replicas have run
    steps of their full token budget before the timed replay starts. The host's CPUs are recorded
    meanwhile: the serving side of the shared-host slowdown."""

    warmup_at_max_replicas: bool = True
    """With ``autoscaling``: once the warm-up has scaled the deployment up to ``max_replicas``, replay
    the warm-up's requests once more (other tokens) and measure the serving side of the shared-host
    slowdown on that round. In the first round the scale-up overlaps the burst that caused it, which
    leaves few or no periods with every replica serving and the host full."""

    arrival_orders: int = Field(default=60, ge=0)
    """Also simulate the slice this many times with each group of simultaneous arrivals (``tie_s``) in
    a random order, for the spread of the simulated percentiles that the order alone makes."""

    tie_s: float = Field(default=0.05, ge=0)
    """Arrivals this close to the first of their group count as simultaneous."""

    request_timeout_s: float = Field(default=900.0, gt=0)
    """No request may take longer."""

    startup_timeout_s: float = Field(default=900.0, gt=0)
    """``swiftkv serve`` must be ready within this."""

    tolerance: float = Field(default=0.15, gt=0)
    """The target for TTFT p50 and throughput: simulated within this share of measured."""

    tolerance_p90: float = Field(default=0.25, gt=0)
    """The target for TTFT p90 (a tail figure: one pass's moved by 50% within a run here)."""

    replica_seconds_tolerance: float = Field(default=0.25, gt=0)
    """With ``autoscaling``: the simulated replica-seconds of each pass within this share of Serve's."""

    @model_validator(mode="after")
    def _from_one(self) -> ValidateConfig:
        if self.autoscaling is not None and self.autoscaling.min_replicas < 1:
            raise ValueError("autoscaling.min_replicas must be at least 1 here (a validation replays against a "
                             "warm replica; Serve's cold start from zero is not what is compared)")
        return self

    out: str = "artifacts/fleet/validate"
    """Folder (or fsspec URI) for ``validation.json``."""

    calibration: ServeCalibration = ServeCalibration()
    """What ``swiftkv fleet calibrate-serve`` measures through this endpoint."""


def served_name(cfg: ValidateConfig) -> str:
    tree = read_yaml_mapping(cfg.serve_config)
    apps = tree.get("applications") or [{"args": tree}]
    return apps[0]["args"]["models"][0]["name"]


def served_deployment(cfg: ValidateConfig) -> tuple[str, str]:
    """(Serve application, deployment) of the replayed model."""
    from serve_apps.app import deployment_name

    apps = read_yaml_mapping(cfg.serve_config).get("applications") or [{}]
    return apps[0].get("name", "swiftkv"), deployment_name(served_name(cfg))


def validation_fleet(cfg: ValidateConfig, **measured: float) -> FleetConfig:
    """The simulated fleet: the validation's settings with what was measured here (front end,
    slowdown, start-up), static at ``replicas`` or autoscaled as ``autoscaling`` (followed at 1 s
    resolution past the last answer, as the real one is watched until it has scaled down)."""
    settings = {**cfg.fleet.model_dump(), **measured}
    if cfg.autoscaling is None:
        return FleetConfig(**settings, model=cfg.model, static_replicas=cfg.replicas)
    settings.update(autoscaling=cfg.autoscaling.model_dump(), timeline_period_s=1.0,
                    idle_tail_s=cfg.scale_down_timeout_s)
    return FleetConfig(**settings, model=cfg.model)


class Endpoint(NamedTuple):
    url: str
    """``http://127.0.0.1:port``."""

    ray_address: str
    """The endpoint's own Ray cluster (its GCS), for a driver that reads Serve's status."""


@contextmanager
def serving(cfg: ValidateConfig, prefill_tokens_per_s: float) -> Iterator[Endpoint]:
    """``swiftkv serve`` in a subprocess until the block ends (then SIGTERM: it drains and stops)."""
    routing = cfg.fleet.routing
    scaling = cfg.autoscaling.model_dump(exclude_none=True) if cfg.autoscaling else \
        {"min_replicas": cfg.replicas, "max_replicas": cfg.replicas}
    sets = {"models.0.prefill_tokens_per_s": prefill_tokens_per_s, "models.0.max_ongoing_requests":
            cfg.fleet.max_ongoing_requests, "models.0.routing.router": routing.router,
            "models.0.routing.prefix_margin_s": routing.prefix_margin_s,
            "models.0.routing.stats_period_s": routing.stats_period_s,
            **{f"models.0.autoscaling.{k}": v for k, v in scaling.items()}}
    command = [str(Path(sys.executable).parent / "swiftkv"), "serve", "--config", cfg.serve_config,
               "--port", str(cfg.port), "--metrics-port", str(cfg.metrics_port),
               *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]
    print("starting:", " ".join(command), flush=True)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RAY_ADDRESS": "local"})
    ready = threading.Event()
    log: list[str] = []
    address: list[str] = []

    def watch() -> None:
        for line in proc.stdout:
            log.append(line)
            if "swiftkv serve: ready" in line:
                address.extend(re.findall(r"Ray at (\S+?)\)", line))
                ready.set()

    threading.Thread(target=watch, daemon=True).start()
    try:
        deadline = time.monotonic() + cfg.startup_timeout_s
        while not ready.wait(2.0):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("swiftkv serve did not come up:\n" + "".join(log[-40:]))
        yield Endpoint(f"http://127.0.0.1:{cfg.port}", address[0] if address else "")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _figures(ttfts: list[float | None], outputs: list[int], span: float) -> dict[str, Any]:
    """TTFT percentiles and throughput over ``span`` seconds (the sum of the passes' spans when pooled)."""
    ok = [t for t in ttfts if t is not None]
    return {"requests": len(ttfts), "failed": len(ttfts) - len(ok),
            "ttft_p50_s": percentile(ok, 50) if ok else None, "ttft_p90_s": percentile(ok, 90) if ok else None,
            "output_tokens_per_s": sum(outputs) / span, "requests_per_s": len(ok) / span}


def measure_engines(cfg: ValidateConfig, host: HostLoad) -> Profile:
    """``swiftkv calibrate`` of the serve config's model, ``cfg.replicas`` engines side by side on a
    local Ray of its own (shut down before the endpoint starts), as the variant ``cfg.model``;
    ``host`` records the host's CPUs meanwhile (what the engines had then, to set beside the replay's)."""
    import ray

    from serve_apps.calibrate import calibrate
    from serve_apps.local import read_app_config

    options = read_app_config(cfg.serve_config, [], []).models[0].model_copy(update={"name": cfg.model})
    eng = cfg.measure.engine
    print(f"measuring the engine profile of {options.model} ({cfg.replicas} side by side)", flush=True)
    ray.init(address="local", include_dashboard=False)
    try:
        with host:
            tree = calibrate([options], eng.input_lens, eng.batches, eng.num_prompts, eng.rounds,
                             eng.decode_contexts, side_by_side=cfg.replicas)
    finally:
        ray.shutdown()
    return parse_config(Profile, {"source": "swiftkv fleet validate (measure.engine)", **tree}, what="profile")


def simulation_inputs(cfg: ValidateConfig, host: HostLoad | None = None) -> Profile:
    """The profile to simulate with: measured now (``host`` records the CPUs meanwhile), or the
    configured file (checked before anything starts)."""
    if cfg.measure:
        return measure_engines(cfg, host or HostLoad())
    if cfg.profile is None:
        raise ValueError("the validate config needs `profile` when `measure` is null")
    return load_profile(cfg.profile)


def shared_host_slowdown(calibration: dict[str, float], serving: dict[str, float]) -> float:
    """How much slower the engines run behind the endpoint than in their calibration when the host has
    no idle core: the cores they had then in the calibration's timed part over those they had while
    serving (the warm-up), at least 1; 1 when either never filled the host."""
    if not calibration.get("saturated_periods") or not serving.get("saturated_periods"):
        return 1.0
    return max(1.0, calibration["engines_when_saturated"] / serving["engines_when_saturated"])


def order_runs(fleet: FleetConfig, trace: Trace, profile: Profile, orders: int, tie_s: float) -> list[RunResult]:
    """The slice simulated ``orders`` times, each with every group of simultaneous arrivals (within
    ``tie_s``) in a random order (seeds 0..orders-1)."""
    return [simulate(fleet, shuffle_simultaneous(trace, tie_s, seed), profile) for seed in range(orders)]


def order_spread(runs: list[RunResult]) -> dict[str, Any]:
    """The simulated TTFT p50 and p90 over ``runs`` (:func:`order_runs`): min, 5th percentile, median,
    95th percentile and max (empty with no runs)."""
    spread = {}
    for key, q in (("ttft_p50_s", 50), ("ttft_p90_s", 90)):
        values = [percentile([r.ttft_s for r in run.requests if r.ttft_s is not None], q) for run in runs]
        if values:
            spread[key] = {"min": min(values), "p5": percentile(values, 5), "median": statistics.median(values),
                           "p95": percentile(values, 95), "max": max(values)}
    return spread


def _run_figures(runs: list[RunResult]) -> dict[str, Any]:
    """Simulated runs' TTFT percentiles over all their requests together and their throughput over the
    sum of their spans (one run: its own figures)."""
    done = [[r for r in run.requests if r.finish_s is not None] for run in runs]
    return _figures([r.ttft_s for run in runs for r in run.requests], [r.output_tokens for one in done for r in one],
                    sum(max((r.finish_s for r in one), default=float("nan")) for one in done))


def _span(records: list[dict[str, Any]]) -> float:
    """A pass's seconds from its start to its last answer."""
    return max(m["sent_s"] + (m["latency_s"] or 0) for m in records)


def pooled_figures(passes: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The passes' TTFT percentiles over all their requests together, and their throughput over the
    sum of their spans (the pauses between them left out)."""
    records = [m for one in passes for m in one]
    return _figures([m["ttft_s"] for m in records], [m["output_tokens"] or 0 for m in records],
                    sum(_span(one) for one in passes))


def _pass_line(figures: dict[str, Any]) -> str:
    p50, p90 = (figures[k] if figures[k] is not None else float("nan") for k in ("ttft_p50_s", "ttft_p90_s"))
    return f"TTFT p50 {p50:.2f} s, p90 {p90:.2f} s, {figures['output_tokens_per_s']:.2f} output tokens/s, " \
        f"{figures['failed']} failed"


def replay_passes(url: str, model: str, trace: Trace, cfg: ValidateConfig, host: HostLoad,
                  watch: ReplicaWatch | None = None) -> list[list[dict[str, Any]]]:
    """The slice replayed ``cfg.replays`` times, ``cfg.replay_pause_s`` apart, pass k with its token ids
    salted by k (pass 0: the trace's own). Each record also has its ``pass`` and ``pass_start_s`` (its
    pass's start in seconds from ``host``'s, where the figure places it). With ``watch`` (an autoscaled
    deployment) every pass starts, and the last ends, with the deployment back at ``min_replicas``."""
    passes = []
    for k in range(cfg.replays):
        if k:
            time.sleep(cfg.replay_pause_s)
        if watch is not None:
            _back_to_min(watch, cfg)
        print(f"replaying the slice: pass {k + 1} of {cfg.replays} ({len(trace.requests)} requests)", flush=True)
        start_s = time.time() - host.started
        records = replay(url, model, trace, PROMPT_VOCAB, cfg.request_timeout_s, salt=k * PASS_SALT)
        passes.append([{**m, "pass": k, "pass_start_s": start_s} for m in records])
        print(f"pass {k + 1}: {_pass_line(pooled_figures(passes[-1:]))}", flush=True)
    if watch is not None:
        _back_to_min(watch, cfg)
    return passes


def warmup_at_full_size(url: str, model: str, warmup: Trace, cfg: ValidateConfig, watch: ReplicaWatch) -> HostLoad:
    """The warm-up's second round, on the deployment at ``max_replicas`` (waited for, bounded by
    ``scale_down_timeout_s``), the host's CPUs recorded meanwhile."""
    replicas = cfg.autoscaling.max_replicas
    print(f"waiting for the deployment to run {replicas} replicas for the warm-up's second round", flush=True)
    waited = watch.wait_for_running(replicas, cfg.scale_down_timeout_s)
    print(f"at {replicas} after {waited:.0f} s; warm-up round 2 ({len(warmup.requests)} requests)", flush=True)
    with HostLoad() as host:
        replay(url, model, warmup, PROMPT_VOCAB, cfg.request_timeout_s, salt=2 * WARMUP_SALT)
    return host


def _back_to_min(watch: ReplicaWatch, cfg: ValidateConfig) -> None:
    replicas = cfg.autoscaling.min_replicas
    print(f"waiting for the deployment to be back at {replicas} replica(s)", flush=True)
    waited = watch.wait_for_running(replicas, cfg.scale_down_timeout_s)
    print(f"back at {replicas} after {waited:.0f} s", flush=True)


def compare_replicas(cfg: ValidateConfig, watch_samples: list[list[float]], watch_started: float,
                     host_started: float, passes: list[list[dict[str, Any]]], run: RunResult) -> dict[str, Any]:
    """Each pass's serving replicas over time on the endpoint (Serve's counts, from the pass's start to
    the next's, or to the end of the watch) against the simulated run's (which starts cold, as every
    pass does) over the same horizon."""
    starts = [host_started + one[0]["pass_start_s"] - watch_started for one in passes]
    ends = [*starts[1:], watch_samples[-1][0] if watch_samples else starts[-1]]
    minimum = cfg.autoscaling.min_replicas
    rows = []
    for k, (start, end) in enumerate(zip(starts, ends, strict=True)):
        # Every pass starts at min_replicas, and the next starts (or the watch ends) as soon as the
        # deployment is back there: the command waits for both, so a scale-down the 1 s polls
        # missed at the end of the window happened by then (at most a poll late).
        measured = [(0.0, minimum)]
        measured += [(t - start, int(running)) for t, running, _ in watch_samples if start < t < end]
        if measured[-1][1] != minimum:
            measured.append((end - start, minimum))
        simulated = [(row["t"], int(row["ready"])) for row in run.timeline]
        real, sim = replica_figures(measured, end - start), replica_figures(simulated, end - start)
        ratio = sim["replica_seconds"] / real["replica_seconds"] if real["replica_seconds"] else None
        rows.append({"pass": k, "horizon_s": end - start, "measured": real, "simulated": sim,
                     "replica_seconds_ratio": ratio,
                     "within_tolerance": ratio is not None and abs(ratio - 1) <= cfg.replica_seconds_tolerance})
    return {"passes": rows, "all_within_tolerance": all(r["within_tolerance"] for r in rows)}


def compare(cfg: ValidateConfig, fleet: FleetConfig, trace: Trace, profile: Profile,
            passes: list[list[dict[str, Any]]], replicas: dict[str, Any] | None = None) -> dict[str, Any]:
    """The replayed ``passes`` against the simulator on the same slice: the simulated figures pooled
    over the trace's order and ``cfg.arrival_orders`` random orders of simultaneous arrivals (on the
    endpoint each pass gets the order its front end accepts a burst in, which the replay does not
    control), their ratios to the measured (all passes pooled), and every request's measured TTFT
    beside its simulated one in the trace's order; with ``replicas`` (an autoscaled deployment's
    watch: ``samples``, ``watch_started``, ``host_started``) its replicas over time against the
    simulated ones, pass by pass."""
    measured = [m for records in passes for m in records]
    real = pooled_figures(passes)
    run = simulate(fleet, trace, profile)
    orders = order_runs(fleet, trace, profile, cfg.arrival_orders, cfg.tie_s)
    sim = _run_figures([run, *orders])
    simulated = run.requests * len(passes)  # the simulation starts cold as every pass does: one run for all
    ratios = {k: sim[k] / real[k] for k in ("ttft_p50_s", "ttft_p90_s", "output_tokens_per_s")
              if real[k] and sim[k] is not None}
    spread = order_spread(orders)
    # How much slower the real replicas ran than the simulated ones, request by request.
    slowdown = [m["ttft_s"] / r.ttft_s for m, r in zip(measured, simulated, strict=True) if m["ttft_s"] and r.ttft_s]
    replica_check = {} if replicas is None else {"replicas": {
        **compare_replicas(cfg, replicas["samples"], replicas["watch_started"], replicas["host_started"], passes, run),
        "startup_s": profile.figures(fleet.model).startup_s if fleet.startup_s is None else fleet.startup_s,
        "startup_times_measured_s": replicas.get("startup_times_measured_s", []),
        "samples": replicas["samples"], "watch_started": replicas["watch_started"],
        "host_started": replicas["host_started"]}}
    return {
        **replica_check,
        "front_end": {k: getattr(fleet, k) for k in ("ingress_s", "ingress_latency_s")},
        "shared_host_slowdown": fleet.shared_host_slowdown,
        "median_measured_over_simulated_ttft": statistics.median(slowdown) if slowdown else None,
        "measured": real, "measured_per_pass": [pooled_figures([one]) for one in passes],
        "simulated": sim, "simulated_in_trace_order": _run_figures([run]),
        "simulated_summary": summarize(run, cfg.fleet.slo_ttft_s),
        "simulated_over_measured": ratios,
        "within_tolerance": {k: abs(v - 1) <= (cfg.tolerance_p90 if k == "ttft_p90_s" else cfg.tolerance)
                             for k, v in ratios.items()},
        "simulated_over_arrival_orders": spread,
        "measured_within_order_spread": {k: v["p5"] <= real[k] <= v["p95"] for k, v in spread.items() if real[k]},
        "per_request": [{**m, "simulated_ttft_s": r.ttft_s, "input_tokens": r.input_tokens,
                         "uncached_tokens_simulated": r.uncached_tokens}
                        for m, r in zip(measured, simulated, strict=True)],
    }


def resimulate(folder: str) -> dict[str, Any]:
    """A saved validation (``validation.json`` and ``profile.json`` in ``folder``) compared again
    with this code's simulator: the same measured passes, profile, front end and slowdown."""
    with fsspec.open(f"{folder}/validation.json", "rt") as f:
        saved = json.load(f)
    with fsspec.open(f"{folder}/profile.json", "rt") as f:
        profile = parse_config(Profile, json.load(f), what=f"{folder}/profile.json")
    missing = [k for k in ("config", "per_request", "front_end", "shared_host_slowdown") if k not in saved]
    if missing:
        # Validations saved before the front end and the slowdown were measured lack what the
        # simulator now needs; guessing them would make a comparison nobody measured.
        raise ValueError(f"{folder}/validation.json has no {', '.join(missing)}: it predates what this "
                         "simulator needs; run `swiftkv fleet validate` again")
    cfg = parse_config(ValidateConfig, saved["config"], what=f"{folder}/validation.json config")
    replicas = saved.get("replicas")
    startup = {"startup_s": replicas["startup_s"]} if replicas and replicas.get("startup_s") is not None else {}
    fleet = validation_fleet(cfg, **saved["front_end"], shared_host_slowdown=saved["shared_host_slowdown"], **startup)
    kept = ("sent_s", "ttft_s", "latency_s", "output_tokens", "error", "pass", "pass_start_s")
    passes: dict[int, list[dict[str, Any]]] = {}
    for m in saved["per_request"]:
        passes.setdefault(m.get("pass", 0), []).append({k: m[k] for k in kept if k in m})
    measured_keys = ("config", "requests", "replay_wall_s", "host_load", "calibration_host_load", "warmup_host_load",
                    "warmup_startups_left_out")
    return {**{k: saved[k] for k in measured_keys if k in saved},
            **compare(cfg, fleet, cfg.traffic.build(), profile, list(passes.values()), replicas)}


def run_validate(cfg: ValidateConfig) -> dict[str, Any]:
    trace = cfg.traffic.build()
    calibration_host = HostLoad()
    profile = simulation_inputs(cfg, calibration_host)
    figures = profile.figures(cfg.model)
    measured: dict[str, float] = {}
    replicas = None
    with serving(cfg, figures.prefill_tokens_per_s) as endpoint, \
            (ReplicaWatch(endpoint.ray_address, *served_deployment(cfg)) if cfg.autoscaling
             else nullcontext()) as watch:
        url, model = endpoint.url, served_name(cfg)
        calibration_cores = calibration_host.summary(figures.timed_unix)  # {} when not measured here
        warmup_host, warmup_cores = HostLoad(), {}
        if cfg.warmup_requests:
            warmup = window(trace, limit=cfg.warmup_requests)
            with warmup_host:
                replay(url, model, warmup, PROMPT_VOCAB, cfg.request_timeout_s, salt=WARMUP_SALT)
            if watch is not None and cfg.warmup_at_max_replicas:
                warmup_host = warmup_at_full_size(url, model, warmup, cfg, watch)
            warmup_end, warmup_cores = time.time(), warmup_host.summary()
        starting: list[tuple[float, float]] = []
        if cfg.measure:
            if watch is not None:
                _back_to_min(watch, cfg)  # the front end is measured on the replicas a pass starts with
            idle = cfg.autoscaling.min_replicas if cfg.autoscaling else cfg.replicas
            front_end = measure_front_end(Burst(url, model, cfg.request_timeout_s), idle,
                                          ReplicaCosts.from_figures(figures), cfg.measure.front_end)
            print(f"front end: {front_end['ingress_s'] * 1000:.0f} ms per request, one at a time, "
                  f"+ {front_end['ingress_latency_s'] * 1000:.0f} ms", flush=True)
            # A replica starting (Ray's actor, imports, the engine's load) takes cores from the one
            # serving: those periods say nothing of a fleet of serving replicas and are left out
            # (the watch has seen every start-up of the warm-up once the fleet is back at its minimum).
            if watch is not None and cfg.warmup_requests:
                starting = [(a, b) for a, b in watch.starting_unix() if a < warmup_end]
                warmup_cores = warmup_host.summary(excluding_unix=starting)
            slowdown = shared_host_slowdown(calibration_cores, warmup_cores)
            unmeasured = "" if warmup_cores.get("saturated_periods") else (
                " (not measured: the warm-up never filled the host with every replica serving)")
            print(f"shared-host slowdown: x{slowdown:.2f}{unmeasured}", flush=True)
            measured.update(front_end, shared_host_slowdown=slowdown)
        t0 = time.time()
        with HostLoad() as host:
            passes = replay_passes(url, model, trace, cfg, host, watch)
        wall_s = time.time() - t0
    if watch is not None:
        started = startup_times(watch.samples)
        print(f"replica start-ups measured: {', '.join(f'{t:.0f} s' for t in started) or 'none'}", flush=True)
        if started:
            measured["startup_s"] = statistics.median(started)
        replicas = {"samples": [[s.t, s.running, s.starting] for s in watch.samples], "watch_started": watch.started,
                    "host_started": host.started, "startup_times_measured_s": started}
    fleet = validation_fleet(cfg, **measured)
    result = {"config": cfg.model_dump(mode="json"), "requests": len(trace.requests), "replay_wall_s": wall_s,
              "host_load": host.to_json(), "calibration_host_load": calibration_cores,
              "warmup_host_load": warmup_cores,
              "warmup_startups_left_out": len(starting), **compare(cfg, fleet, trace, profile, passes, replicas)}
    write_files(cfg.out, {"validation.json": json.dumps(result, indent=1).encode(),
                          "profile.json": profile_json(profile).encode(),
                          "validation.png": validation_png(result["per_request"], host.samples)})
    return result


def _at(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.0f}"


def format_validation(result: dict[str, Any]) -> str:
    rows = ["| figure | measured | simulated | simulated / measured |", "|---|---:|---:|---:|"]
    for key, label in (("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p90_s", "TTFT p90 (s)"),
                       ("output_tokens_per_s", "output tokens/s")):
        real, sim = result["measured"][key], result["simulated"][key]
        ratio = result["simulated_over_measured"].get(key)
        rows.append(f"| {label} | {real:.3g} | {sim:.3g} | {ratio:.2f} |" if ratio else f"| {label} | - | - | - |")
    replicas = result.get("replicas")
    if replicas:
        rows += ["", "| pass | replica-seconds measured / simulated | ratio | peak at (s) measured / simulated | "
                 "back down at (s) measured / simulated |", "|---|---:|---:|---:|---:|"]
        for row in replicas["passes"]:
            real, sim = row["measured"], row["simulated"]
            ratio = f"{row['replica_seconds_ratio']:.2f}" if row["replica_seconds_ratio"] else "-"
            rows.append(f"| {row['pass'] + 1} | {real['replica_seconds']:.0f} / {sim['replica_seconds']:.0f} | "
                        f"{ratio} | "
                        f"{_at(real['peak_at_s'])} / {_at(sim['peak_at_s'])} (peak {real['peak']} / {sim['peak']}) | "
                        f"{_at(real['back_down_at_s'])} / {_at(sim['back_down_at_s'])} |")
    summary = f"requests: {result['requests']}, failed (measured): {result['measured']['failed']}"
    if replicas:
        measured = ", ".join(f"{t:.0f} s" for t in replicas["startup_times_measured_s"]) or "none"
        summary += f", replica start-up measured: {measured} (simulated with {replicas['startup_s']:.0f} s)"
    front = result.get("front_end")
    if front:
        summary += (f", front end: {front['ingress_s'] * 1000:.0f} ms per request one at a time + "
                    f"{front['ingress_latency_s'] * 1000:.0f} ms")
    slowdown = result["median_measured_over_simulated_ttft"]
    if slowdown is not None:
        summary += f", median measured / simulated TTFT per request: {slowdown:.2f}"
    trace_order = result.get("simulated_in_trace_order")
    orders = result.get("config", {}).get("arrival_orders")
    if trace_order and orders:
        summary += (f"\nsimulated: pooled over the trace's order and {orders} random orders of simultaneous "
                    f"arrivals; in the trace's order alone TTFT p50 {trace_order['ttft_p50_s']:.2f} s, "
                    f"p90 {trace_order['ttft_p90_s']:.2f} s")
    passes = result.get("measured_per_pass", [])
    if len(passes) > 1:
        summary += f"\nmeasured: the {len(passes)} passes below pooled\n" + "\n".join(
            f"pass {k + 1}: {_pass_line(figures)}" for k, figures in enumerate(passes))
    for key, label in (("ttft_p50_s", "p50"), ("ttft_p90_s", "p90")):
        spread = result.get("simulated_over_arrival_orders", {}).get(key)
        if spread:
            summary += (f"\nsimulated TTFT {label} over random orders of simultaneous arrivals: "
                        f"{spread['min']:.2f} / {spread['p5']:.2f} / {spread['median']:.2f} / {spread['p95']:.2f} / "
                        f"{spread['max']:.2f} s (min / 5% / median / 95% / max); measured "
                        f"{result['measured'][key]:.2f} s")
    host = result.get("host_load", {}).get("summary")
    if host:
        summary += (f"\nhost CPUs during the replay (mean cores): this run {host['ours']:.2f} (engines "
                    f"{host['engines']:.2f}), other processes {host['others']:.2f}, steal {host['steal']:.2f}, "
                    f"idle {host['idle']:.2f}; others + steal in the worst 10 s: "
                    f"{host['others_plus_steal_worst_10_s']:.2f}")
        if host["saturated_periods"]:
            summary += (f"; in the {host['saturated_periods']} periods with no core idle: engines "
                        f"{host['engines_when_saturated']:.2f}, rest of this run "
                        f"{host['ours_when_saturated'] - host['engines_when_saturated']:.2f}, others + steal "
                        f"{host['others_when_saturated'] + host['steal_when_saturated']:.2f}")
    warmup = result.get("warmup_host_load")
    if warmup and warmup["saturated_periods"]:
        summary += (f"\nduring the warm-up, in the {warmup['saturated_periods']} periods with no core idle: engines "
                    f"{warmup['engines_when_saturated']:.2f}, rest of this run "
                    f"{warmup['ours_when_saturated'] - warmup['engines_when_saturated']:.2f}")
    if result.get("warmup_startups_left_out"):
        summary += (f"\nthe warm-up's periods with a replica starting ({result['warmup_startups_left_out']} "
                    "start-up(s)) are left out of its figures and the slowdown")
    if result.get("shared_host_slowdown", 1.0) != 1.0:
        summary += (f"\nsimulated steps started while every replica is busy: x{result['shared_host_slowdown']:.2f} "
                    "(the engines' cores with none idle, calibration over warm-up)")
    calibration = result.get("calibration_host_load")
    if calibration:
        summary += (f"\nduring the engine calibration's timed part (mean cores): engines {calibration['engines']:.2f}, "
                    f"rest of this run {calibration['ours'] - calibration['engines']:.2f}, others + steal "
                    f"{calibration['others'] + calibration['steal']:.2f}, idle {calibration['idle']:.2f}")
        if calibration["saturated_periods"]:
            summary += (f"; in the {calibration['saturated_periods']} periods with no core idle: engines "
                        f"{calibration['engines_when_saturated']:.2f}")
    return "\n".join(rows) + "\n\n" + summary
