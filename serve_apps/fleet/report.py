"""``swiftkv fleet report``: every (model variant, fleet kind) on the same traffic, one table, the
issue's targets checked, the Serve tuning search shown, and the replicas/TTFT timeline of the main
comparison. :mod:`serve_apps.fleet.grid` says how each fleet is found.

A ratio between two fleets is quoted as a target's figure only when both meet the SLO; otherwise the
target says which fleet misses it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import Field

from serve_apps.fleet.config import FleetSettings, TrafficConfig
from serve_apps.fleet.grid import FleetKind, Grid, ServeTuning, label, meets
from serve_apps.fleet.plots import timeline_png
from serve_apps.fleet.profile import Profile, ReplicaCosts
from serve_apps.fleet.run_cache import RunCache
from swiftkv.outputs import write_files
from swiftkv.yaml_config import StrictConfig

BASE = "base"
DEFAULT_FLEETS = [FleetKind(policy="static", router="pow2"), FleetKind(policy="static", router="prefill"),
                  FleetKind(policy="serve-defaults", router="pow2"), FleetKind(policy="serve-tuned", router="pow2"),
                  FleetKind(policy="prefill", router="prefill")]


class ReportConfig(StrictConfig):
    """The comparison: variants x fleets on one traffic."""

    traffic: TrafficConfig
    """The requests every fleet replays."""

    profile: str
    """The profile file the replicas are modelled from."""

    variants: list[str] = [BASE, "swiftkv-50", "swiftkv-50-acrosskv"]
    """Model variants (keys of the profile's ``models``); ``base`` is the baseline of every ratio."""

    fleets: list[FleetKind] = DEFAULT_FLEETS
    """The fleets each variant runs on (``serve_apps.fleet.grid``)."""

    fleet: FleetSettings = FleetSettings()
    """Settings shared by every run (bounds, the warm pool ``autoscaling.min_replicas``, our policy's
    options, SLO, ``score_from_s``...); each fleet kind sets its policy, router and Serve options."""

    tuning: ServeTuning = ServeTuning()
    """The search behind ``serve-tuned``."""

    slo_attainment_target: float = Field(default=0.99, gt=0, le=1)
    """Share of the feasible scored requests (those an idle replica prefills within the SLO) that must
    meet it: a fleet meets the SLO with at least this; sizes the static fleets."""

    main: list[str] = ["base/static/pow2", "base/serve-defaults/pow2", "swiftkv-50/prefill/prefill"]
    """Runs drawn in the timeline plot (``variant/policy/router``)."""

    out: str = "artifacts/fleet/report"
    """Folder (or fsspec URI) for ``results.json``, ``report.md`` and ``timeline.png``."""

    static_fleets: dict[str, int] = {}
    """``variant/router`` -> a static fleet size to take instead of searching for the smallest; the
    report says so."""

    paper_checks: bool = False
    """For a profile derived by ``swiftkv fleet derive-h100``: check it against the paper's figures
    (:func:`serve_apps.fleet.paper_profile.checks`), print the check table, and write beside each
    target the figures its variant misses by more than 15%."""

    reuse_runs: bool = True
    """Keep each run's figures under ``out/runs/`` keyed on its config and the code that computes it
    (:mod:`serve_apps.fleet.run_cache`): an interrupted report resumes, reports over parts of the
    grid (``--set variants=[base]``, run side by side) fill one cache, and a run made by other code
    is computed again."""


def all_runs(cfg: ReportConfig, grid: Grid) -> dict[str, dict[str, Any]]:
    return {label(variant, kind.name): grid.kind(variant, kind, cfg.static_fleets.get(f"{variant}/{kind.router}"))
            for variant in cfg.variants for kind in cfg.fleets}


def _ratio(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    return (f"{ours['replica_hours'] / theirs['replica_hours']:.2f}x the replica-hours, "
            f"{ours['goodput_per_replica_hour'] / theirs['goodput_per_replica_hour']:.2f}x the goodput per "
            "replica-hour")


def _rate(profile: Profile, variant: str, tokens: int | None) -> float:
    """The variant's prefill rate where the fleets read their capacity (the profile's own figure by default)."""
    figures = profile.figures(variant)
    return figures.prefill_tokens_per_s if tokens is None else ReplicaCosts.from_figures(figures).prefill_rate(tokens)


def targets(cfg: ReportConfig, runs: dict[str, dict[str, Any]], profile: Profile,
            caveats: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The issue's targets and the ratios reported whatever they are, each with its figures (and the
    variant's ``caveats``, the profile's misses against published figures); ``met`` is None for a
    figure that has no target."""
    out: list[dict[str, Any]] = []
    caveats = caveats or {}
    attainment = cfg.slo_attainment_target

    def missing(*keys: str) -> str:
        return ", ".join(f"{k} misses the SLO ({runs[k]['summary']['feasible_slo_attainment']:.2%})"
                         for k in keys if not meets(runs[k]["summary"], attainment))

    for variant in (v for v in cfg.variants if v != BASE):
        first = len(out)
        ours = f"{variant}/prefill/prefill"
        for base, bar in ((f"{BASE}/serve-defaults/pow2", (0.5, 2.0)), (f"{BASE}/serve-tuned/pow2", None),
                          (f"{BASE}/prefill/prefill", None)):
            if ours not in runs or base not in runs:
                continue
            a, b = runs[ours]["summary"], runs[base]["summary"]
            name = f"{ours} vs {base}" + (f": <= {bar[0]}x the replica-hours, >= {bar[1]:g}x the goodput per "
                                          "replica-hour, both meeting the SLO" if bar else " (reported)")
            if missing(ours, base):
                out.append({"target": name, "figures": f"not quoted: {missing(ours, base)}", "met": False})
                continue
            hours = a["replica_hours"] / b["replica_hours"]
            goodput = a["goodput_per_replica_hour"] / b["goodput_per_replica_hour"]
            out.append({"target": name, "figures": _ratio(a, b),
                        "met": hours <= bar[0] and goodput >= bar[1] if bar else None})
        alone, base = f"{variant}/static/prefill", f"{BASE}/static/prefill"
        if alone in runs and base in runs:
            tokens = cfg.fleet.capacity_input_tokens
            limit = _rate(profile, BASE, tokens) / _rate(profile, variant, tokens)
            a, b = runs[alone]["summary"], runs[base]["summary"]
            figures = (f"not quoted: {missing(alone, base)}" if missing(alone, base) else
                       f"{a['replica_hours'] / b['replica_hours']:.2f}x the replica-hours (x{a['peak_replicas']} vs "
                       f"x{b['peak_replicas']}); the profile's prefill rates allow {limit:.2f}x")
            out.append({"target": f"SwiftKV alone: {alone} vs {base} (reported)", "figures": figures, "met": None})
        misses = "; ".join(caveats[v] for v in (variant, BASE) if v in caveats)
        for target in out[first:] if misses else ():
            target["figures"] += f" (the profile against the paper: {misses})"
    return out


def _ms(seconds: float) -> str:
    return "never" if math.isinf(seconds) else f"{seconds:.2f}"


def _fleet_name(policy: str, run: dict[str, Any]) -> str:
    s, scaling = run["summary"], run.get("autoscaling") or {}
    if policy == "static":
        return f"static x{s['peak_replicas']}"
    if policy == "prefill":
        return "ours (prefill)"
    return (f"Serve {'defaults' if policy == 'serve-defaults' else 'tuned'} (target "
            f"{scaling['target_ongoing_requests']:g}, delays {scaling['upscale_delay_s']:g} / "
            f"{scaling['downscale_delay_s']:g} s)")


def format_report(cfg: ReportConfig, runs: dict[str, dict[str, Any]], checks: list[dict[str, Any]],
                  paper_checks: list[dict[str, Any]] | None = None) -> str:
    slo, attainment = cfg.fleet.slo_ttft_s, cfg.slo_attainment_target
    lines = [f"# Fleet report: TTFT SLO {slo:g} s for {attainment:.0%} of the feasible requests", "",
             "| variant | fleet | router | meets SLO | replica-hours | goodput / replica-hour | "
             "SLO attainment (feasible / all) | TTFT p50 / p90 / p99 (s) | scale events (/h) | peak replicas | "
             "uncached prompt share | preemptions |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, run in runs.items():
        variant, policy, router = key.split("/")
        s, t = run["summary"], run["summary"]["ttft_s"]
        lines.append(f"| {variant} | {_fleet_name(policy, run)} | {router} | "
                     f"{'yes' if meets(s, attainment) else '**no**'} | {s['replica_hours']:.1f} | "
                     f"{s['goodput_per_replica_hour']:,.0f} | {s['feasible_slo_attainment']:.2%} / "
                     f"{s['slo_attainment']:.2%} | {_ms(t['p50'])} / {_ms(t['p90'])} / {_ms(t['p99'])} | "
                     f"{s['scale_events']} ({s['scale_events_per_hour']:.1f}) | {s['peak_replicas']} | "
                     f"{s['uncached_prompt_share']:.2f} | {s['preemptions']:,} |")
    lines += [f"\nThe static fleet for {k} is given ({n} replicas, `static_fleets`), not the smallest found by "
              "the search." for k, n in cfg.static_fleets.items()]
    searched = {k: r["search"] for k, r in runs.items() if "search" in r}
    if searched:
        lines += ["", "Serve's request-count policy, tuned (metrics interval and look-back at Serve's defaults; "
                  "a candidate that misses too often is stopped early):", "",
                  "| fleet | target_ongoing_requests | upscale / downscale delay (s) | replica-hours | "
                  "SLO attainment (feasible) | meets SLO |", "|---|---:|---:|---:|---:|---|"]
        lines += [f"| {k} | {c['target_ongoing_requests']:g} | {c['upscale_delay_s']:g} / {c['downscale_delay_s']:g} | "
                  + ("stopped early | - | **no** |" if c["stopped_early"] else
                     f"{c['replica_hours']:.1f} | {c['feasible_slo_attainment']:.2%} | "
                     f"{'yes' if c['meets_slo'] else '**no**'} |")
                  for k, cands in searched.items() for c in cands]
    lines += ["", "| target | figures | met |", "|---|---|---|"]
    lines += [f"| {c['target']} | {c['figures']} | {'-' if c['met'] is None else 'yes' if c['met'] else '**no**'} |"
              for c in checks]
    if paper_checks:
        from serve_apps.fleet.paper_profile import format_checks

        lines += ["", "The profile against the paper's figures (`swiftkv fleet derive-h100`; the four marked "
                  "fitted, the rest held out):", "", format_checks(paper_checks)]
    return "\n".join(lines) + "\n"


def run_report(cfg: ReportConfig, profile: Profile) -> dict[str, Any]:
    trace = cfg.traffic.build()
    for variant in cfg.variants:
        profile.figures(variant)  # a missing variant fails before any run
    grid = Grid(cfg.fleet, trace, cfg.traffic.model_dump(mode="json"), profile, cfg.slo_attainment_target,
                cfg.tuning, RunCache(f"{cfg.out}/runs") if cfg.reuse_runs else None)
    paper = None
    if cfg.paper_checks:  # before the runs: a profile without the paper's variants fails in seconds, not hours
        from serve_apps.fleet.paper_profile import caveats, checks

        paper = checks(profile)
    runs = all_runs(cfg, grid)
    goals = targets(cfg, runs, profile, caveats(paper) if paper else None)
    results = {"config": cfg.model_dump(mode="json"), "requests": len(trace.requests),
               "duration_s": trace.duration_s, "runs": runs, "targets": goals, "paper_checks": paper}
    report = format_report(cfg, runs, goals, paper)
    write_files(cfg.out, {"results.json": json.dumps(results, indent=1, default=str).encode(),
                          "report.md": report.encode(),
                          "timeline.png": timeline_png({k: runs[k]["timeline"] for k in cfg.main if k in runs},
                                                       cfg.fleet.slo_ttft_s)})
    return results
