"""``swiftkv fleet report``: every (model variant, fleet, router) combination on the same traffic,
one table, the issue's targets checked, and the replicas/TTFT timeline of the main comparison.

Fleets: ``static`` (the smallest fixed fleet that meets the SLO for ``slo_attainment_target`` of the
requests an idle replica could answer in time: sized for the peak, found by bisection), ``requests``
(Serve's default request-count policy) and ``prefill`` (ours); routers: ``pow2`` (Serve's default)
and ``prefill`` (ours). The
autoscaled fleets start warm at the static fleet's size (the traffic did not begin with the trace),
and Serve's policy gets a tuned ``target_ongoing_requests``: the ongoing requests per replica the
static fleet carried while meeting the SLO (Serve's default of 2 would ask for a replica per two
requests of a replica that batches dozens).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Literal

import fsspec
from pydantic import Field
from tqdm import tqdm

from serve_apps.fleet.config import FleetConfig, FleetSettings, TrafficConfig
from serve_apps.fleet.plots import timeline_png
from serve_apps.fleet.profile import Profile, ReplicaCosts
from serve_apps.fleet.results import summarize, timeline
from serve_apps.fleet.simulator import simulate
from serve_apps.fleet.trace import Trace
from swiftkv.outputs import write_files
from swiftkv.yaml_config import StrictConfig

Policy = Literal["static", "requests", "prefill"]
RouterName = Literal["pow2", "prefill"]
BASELINE_STATIC = "base/static/pow2"
BASELINE_DEFAULTS = "base/requests/pow2"


class ReportConfig(StrictConfig):
    """The comparison grid."""

    traffic: TrafficConfig
    """The requests every fleet replays."""

    profile: str
    """The profile file the replicas are modelled from."""

    variants: list[str] = ["base", "swiftkv-50", "swiftkv-50-acrosskv"]
    """Model variants (keys of the profile's ``models``)."""

    policies: list[Policy] = ["static", "requests", "prefill"]
    """Fleets to compare."""

    routers: list[RouterName] = ["pow2", "prefill"]
    """Routers to compare."""

    fleet: FleetSettings = FleetSettings()
    """Settings shared by every run (delays, bounds, TTFT budget, request-count target, SLO...);
    ``autoscaling.policy`` and ``routing.router`` are set per run."""

    slo_attainment_target: float = Field(default=0.99, gt=0, le=1)
    """Share of the feasible requests (those an idle replica prefills within the SLO) that must meet
    it: sizes the static fleets; the targets' bar."""

    tune_requests_target: bool = True
    """Serve's policy aims at the static fleet's ongoing requests per replica (same variant and router);
    false: at ``fleet.autoscaling.target_ongoing_requests``."""

    main: list[str] = [BASELINE_STATIC, BASELINE_DEFAULTS, "swiftkv-50/prefill/prefill"]
    """Runs drawn in the timeline plot (``variant/policy/router``)."""

    out: str = "artifacts/fleet/report"
    """Folder (or fsspec URI) for ``results.json``, ``report.md`` and ``timeline.png``."""

    static_fleets: dict[str, int] = {}
    """``variant/router`` -> a static fleet size to take instead of searching for the smallest (e.g. a
    search cut short: the smallest fleet known to pass); the report says so."""

    reuse_runs: bool = True
    """Keep each run's figures under ``out/runs/`` (named by a hash of its fleet, traffic, variant figures
    and miss budget) and reuse them: an interrupted report resumes, and reports over parts of the grid
    (``--set variants=[base]``, run side by side) fill one cache a full report then reads. Delete the
    folder after changing the simulator itself."""


def run_key(variant: str, policy: str, router: str) -> str:
    return f"{variant}/{policy}/{router}"


class Grid:
    """Runs the grid with one progress bar per run (simulated seconds)."""

    def __init__(self, cfg: ReportConfig, trace: Trace, profile: Profile) -> None:
        self.cfg, self.trace, self.profile = cfg, trace, profile
        for variant in cfg.variants:
            profile.figures(variant)  # a missing variant fails before any run

    def fleet(self, variant: str, policy: str, router: str, replicas: int, target: float | None) -> FleetConfig:
        """A static fleet of ``replicas``, or an autoscaled one starting there."""
        settings = self.cfg.fleet.model_dump()
        settings["routing"]["router"] = router
        if policy == "static":
            return FleetConfig(**settings, model=variant, static_replicas=replicas)
        scaling = settings["autoscaling"]
        scaling.update(policy=policy, initial_replicas=min(max(replicas, scaling["min_replicas"]),
                                                           scaling["max_replicas"]))
        if target is not None:
            scaling["target_ongoing_requests"] = target
        return FleetConfig(**settings, model=variant)

    def run(self, variant: str, policy: str, router: str, replicas: int, target: float | None = None,
            miss_budget: int | None = None) -> dict[str, Any]:
        label = run_key(variant, policy, router) + (f" x{replicas}" if policy == "static" else "")
        fleet = self.fleet(variant, policy, router, replicas, target)
        cached = None
        if self.cfg.reuse_runs:
            key = hashlib.sha256(json.dumps(
                {"fleet": fleet.model_dump(mode="json"), "traffic": self.cfg.traffic.model_dump(mode="json"),
                 "figures": self.profile.figures(variant).model_dump(mode="json"), "miss_budget": miss_budget},
                sort_keys=True).encode()).hexdigest()[:16]
            fs, root = fsspec.core.url_to_fs(f"{self.cfg.out}/runs")
            cached = f"{root}/{label.replace('/', '_').replace(' ', '_')}-{key}.json"
            if fs.exists(cached):
                with fs.open(cached, "r") as f:
                    return json.load(f)
        with tqdm(total=round(self.trace.duration_s), desc=label, unit="sim s", leave=False) as bar:
            def progress(now: float) -> None:
                bar.update(min(round(now), bar.total) - bar.n)

            result = simulate(fleet, self.trace, self.profile, progress, miss_budget)
        figures = {"summary": summarize(result, self.cfg.fleet.slo_ttft_s),
                   "timeline": timeline(result, self.cfg.fleet.timeline_period_s),
                   "target_ongoing_requests": None if policy == "static" else fleet.autoscaling.target_ongoing_requests}
        if cached:
            fs.makedirs(fs._parent(cached), exist_ok=True)
            fs.pipe(cached, json.dumps(figures, default=str).encode())
            figures = json.loads(json.dumps(figures, default=str))  # as a reuse reads it back
        return figures

    def static(self, variant: str, router: str, guess: int) -> dict[str, Any]:
        """The smallest static fleet meeting the attainment target, to within 5% (bisection from ``guess``)."""
        target = self.cfg.slo_attainment_target
        slo = self.cfg.fleet.slo_ttft_s
        costs = ReplicaCosts.from_figures(self.profile.figures(variant))
        feasible = sum(costs.idle_ttft_s(r.input_tokens) <= slo for r in self.trace.requests)
        budget = math.floor((1 - target) * feasible)  # a probe that misses more has failed: stop it there
        probes: dict[int, dict[str, Any]] = {}
        given = self.cfg.static_fleets.get(f"{variant}/{router}")
        if given is not None:
            best = self.run(variant, "static", router, given, miss_budget=budget)
            if best["summary"]["stopped_early"]:
                best = self.run(variant, "static", router, given)
            best["probes"] = f"given (static_fleets): x{given}, not searched"
            return best

        def meets(n: int) -> bool:
            if n not in probes:
                probes[n] = self.run(variant, "static", router, n, miss_budget=budget)
                summary = probes[n]["summary"]
                tqdm.write(f"{run_key(variant, 'static', router)} x{n}: " + (
                    "over the miss budget, stopped" if summary["stopped_early"] else
                    f"attainment {summary['feasible_slo_attainment']:.2%} of feasible requests"))
            return not probes[n]["summary"]["stopped_early"] and \
                probes[n]["summary"]["feasible_slo_attainment"] >= target

        cap = self.cfg.fleet.autoscaling.max_replicas
        high = min(max(1, guess), cap)
        while not meets(high) and high < cap:
            high = min(2 * high, cap)
        low = 0  # known to fail (or nothing smaller to try)
        if meets(high):
            low = high // 2
            while low and meets(low):
                high, low = low, low // 2
            while high - low > max(1, high // 20):  # within 5%: a probe of a large fleet is slow
                mid = (low + high) // 2
                if meets(mid):
                    high = mid
                else:
                    low = mid
        best = probes[high]
        if best["summary"]["stopped_early"]:  # even the largest fleet fails: run it through for its figures
            best = self.run(variant, "static", router, high)
        best["probes"] = {n: "failed (stopped early)" if p["summary"]["stopped_early"] else
                          p["summary"]["feasible_slo_attainment"] for n, p in sorted(probes.items())}
        return best

    def guess(self, variant: str) -> int:
        """Replicas for the busiest minute's prompt tokens at the calibrated prefill rate, all uncached."""
        per_minute: dict[int, int] = {}
        for r in self.trace.requests:
            per_minute[int(r.arrival_s // 60)] = per_minute.get(int(r.arrival_s // 60), 0) + r.input_tokens
        return math.ceil(max(per_minute.values()) / 60 / self.profile.figures(variant).prefill_tokens_per_s)

    def all(self) -> dict[str, dict[str, Any]]:
        runs: dict[str, dict[str, Any]] = {}
        for variant in self.cfg.variants:
            for router in self.cfg.routers:
                static = self.static(variant, router, self.guess(variant))
                if "static" in self.cfg.policies:
                    runs[run_key(variant, "static", router)] = static
                replicas = static["summary"]["peak_replicas"]
                target = (max(1.0, round(static["summary"]["mean_ongoing_per_replica"], 1))
                          if self.cfg.tune_requests_target else None)
                for policy in (p for p in self.cfg.policies if p != "static"):
                    runs[run_key(variant, policy, router)] = self.run(variant, policy, router, replicas, target)
        return runs


def targets(runs: dict[str, dict[str, Any]], attainment: float) -> list[dict[str, Any]]:
    """The issue's targets, each with the figures behind it and whether it is met."""
    out = []
    ours = [k for k in runs if k.endswith("/prefill/prefill") and not k.startswith("base/")]
    for key in ours:
        s = runs[key]["summary"]
        if BASELINE_STATIC in runs:
            base = runs[BASELINE_STATIC]["summary"]
            ratio = s["replica_hours"] / base["replica_hours"]
            out.append({"target": f"{key}: SLO met for >= {attainment:.0%} of (feasible) requests with <= 0.5x "
                                  f"the replica-hours of {BASELINE_STATIC}",
                        "figures": f"attainment {s['feasible_slo_attainment']:.2%} of feasible requests "
                                   f"({s['slo_attainment']:.2%} of all), replica-hours {ratio:.2f}x",
                        "met": s["feasible_slo_attainment"] >= attainment and ratio <= 0.5})
        if BASELINE_DEFAULTS in runs:
            base = runs[BASELINE_DEFAULTS]["summary"]
            ratio = s["goodput_per_replica_hour"] / base["goodput_per_replica_hour"]
            out.append({"target": f"{key}: >= 2x the goodput per replica-hour of {BASELINE_DEFAULTS}",
                        "figures": f"{ratio:.2f}x", "met": ratio >= 2})
        requests_key = key.replace("/prefill/prefill", "/requests/prefill")
        if requests_key in runs:
            theirs = runs[requests_key]["summary"]["scale_events_per_hour"]
            out.append({"target": f"{key}: no oscillation (scale events per hour vs {requests_key})",
                        "figures": f"{s['scale_events_per_hour']:.1f} vs {theirs:.1f}",
                        "met": s["scale_events_per_hour"] <= theirs})
    return out


def _ms(seconds: float) -> str:
    return "never" if math.isinf(seconds) else f"{seconds:.2f}"


def format_report(cfg: ReportConfig, runs: dict[str, dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    slo = cfg.fleet.slo_ttft_s
    lines = [f"# Fleet report: TTFT SLO {slo:g} s", "",
             "| variant | fleet | router | replica-hours | goodput / replica-hour | SLO attainment (feasible / all) | "
             "TTFT p50 / p90 / "
             "p99 (s) | scale events (/h) | peak replicas | uncached prompt share |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, run in runs.items():
        variant, policy, router = key.split("/")
        s = run["summary"]
        fleet = {"static": f"static x{s['peak_replicas']}", "prefill": "ours (prefill)",
                 "requests": f"Serve requests (target {run.get('target_ongoing_requests') or 0:.0f})"}[policy]
        t = s["ttft_s"]
        lines.append(f"| {variant} | {fleet} | {router} | {s['replica_hours']:.1f} | "
                     f"{s['goodput_per_replica_hour']:,.0f} | {s['feasible_slo_attainment']:.2%} / "
                     f"{s['slo_attainment']:.2%} | {_ms(t['p50'])} / "
                     f"{_ms(t['p90'])} / {_ms(t['p99'])} | {s['scale_events']} ({s['scale_events_per_hour']:.1f}) | "
                     f"{s['peak_replicas']} | {s['uncached_prompt_share']:.2f} |")
    lines += [f"\nThe static fleet for {k} is given ({n} replicas, `static_fleets`), not the smallest found by "
              "the search." for k, n in cfg.static_fleets.items()]
    lines += ["", "| target | figures | met |", "|---|---|---|"]
    lines += [f"| {c['target']} | {c['figures']} | {'yes' if c['met'] else '**no**'} |" for c in checks]
    return "\n".join(lines) + "\n"


def run_report(cfg: ReportConfig, profile: Profile) -> dict[str, Any]:
    trace = cfg.traffic.build()
    runs = Grid(cfg, trace, profile).all()
    checks = targets(runs, cfg.slo_attainment_target)
    results = {"config": cfg.model_dump(mode="json"), "requests": len(trace.requests),
               "duration_s": trace.duration_s, "runs": runs, "targets": checks}
    report = format_report(cfg, runs, checks)
    write_files(cfg.out, {"results.json": json.dumps(results, indent=1, default=str).encode(),
                          "report.md": report.encode(),
                          "timeline.png": timeline_png({k: runs[k]["timeline"] for k in cfg.main if k in runs},
                                                       cfg.fleet.slo_ttft_s)})
    return results
