"""The runs of a fleet report: one fleet per (model variant, fleet kind), each found the way an
operator would set it up.

- ``static``: the smallest fixed fleet that meets the SLO, exact to the replica (doubling from a
  guess, then bisection until one replica apart; a probe stops as soon as it has missed too often).
- ``serve-defaults``: Serve's request-count policy with every option it has at the installed Serve's
  default (:func:`~serve_apps.fleet.serve_control.serve_autoscaling_defaults`), started cold.
- ``serve-tuned``: the same policy with ``target_ongoing_requests`` and the up/down delays chosen by a
  search over :class:`ServeTuning` (the fleet with the fewest replica-hours that meets the SLO; the
  most attainment if none does), every candidate kept for the report.
- ``prefill``: our policy with the deployment's own options, started cold.

Autoscaled fleets start at ``fleet.autoscaling.min_replicas``, the warm pool an operator keeps.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field
from tqdm import tqdm

from serve_apps.fleet.config import FleetConfig, FleetSettings
from serve_apps.fleet.profile import Profile, ReplicaCosts
from serve_apps.fleet.results import summarize, timeline
from serve_apps.fleet.run_cache import RunCache, run_key
from serve_apps.fleet.serve_control import serve_autoscaling_defaults
from serve_apps.fleet.simulator import simulate
from serve_apps.fleet.trace import Trace
from swiftkv.yaml_config import StrictConfig

Policy = Literal["static", "serve-defaults", "serve-tuned", "prefill"]
RouterName = Literal["pow2", "prefill"]


class FleetKind(StrictConfig):
    """One row of the report per variant: how the fleet is sized and which router places requests."""

    policy: Policy
    """``static`` (smallest meeting the SLO), ``serve-defaults``, ``serve-tuned`` (Serve's request-count
    policy) or ``prefill`` (ours)."""

    router: RouterName
    """``pow2`` (Serve's default) or ``prefill`` (ours)."""

    @property
    def name(self) -> str:
        return f"{self.policy}/{self.router}"


class ServeTuning(StrictConfig):
    """The search behind ``serve-tuned``: every pair of a target and a delay setting is run."""

    targets: list[float] = Field(default=[4.0, 8.0, 16.0, 32.0], min_length=1)
    """``target_ongoing_requests`` values to try (Serve's default is 2; a vLLM replica batches dozens)."""

    delays: list[tuple[float, float]] = Field(default=[(30.0, 600.0), (5.0, 60.0)], min_length=1)
    """(``upscale_delay_s``, ``downscale_delay_s``) pairs to try; the metrics interval and look-back
    stay at Serve's defaults."""


def label(variant: str, kind: str) -> str:
    return f"{variant}/{kind}"


def meets(summary: dict[str, Any], attainment: float) -> bool:
    """The run finished and met the SLO for ``attainment`` of its feasible scored requests."""
    return not summary["stopped_early"] and summary["feasible_slo_attainment"] >= attainment


class Grid:
    """Runs a report's fleets (one progress bar per run, in simulated seconds), each run's figures
    kept in a :class:`~serve_apps.fleet.run_cache.RunCache` when ``cache`` is given."""

    def __init__(self, settings: FleetSettings, trace: Trace, trace_config: dict[str, Any], profile: Profile,
                 attainment: float, tuning: ServeTuning, cache: RunCache | None) -> None:
        self.settings, self.trace, self.trace_config, self.profile = settings, trace, trace_config, profile
        self.attainment, self.tuning, self.cache = attainment, tuning, cache

    def _budget(self, variant: str) -> int:
        """Misses (feasible scored requests past their SLO) a passing fleet can afford."""
        costs = ReplicaCosts.from_figures(self.profile.figures(variant))
        feasible = sum(costs.idle_ttft_s(r.input_tokens) <= self.settings.slo_ttft_s
                       for r in self.trace.requests if r.arrival_s >= self.settings.score_from_s)
        return math.floor((1 - self.attainment) * feasible)

    def fleet(self, variant: str, router: str, *, replicas: int | None = None,
              autoscaling: dict[str, Any] | None = None) -> FleetConfig:
        """A static fleet of ``replicas``, or an autoscaled one with ``autoscaling`` over the settings'."""
        settings = self.settings.model_dump()
        settings["routing"]["router"] = router
        settings["autoscaling"].update(autoscaling or {})
        return FleetConfig(**settings, model=variant, static_replicas=replicas)

    def run(self, name: str, fleet: FleetConfig, miss_budget: int | None = None) -> dict[str, Any]:
        """One run's summary and timeline (read back if the cache holds this very run)."""
        key = run_key({"fleet": fleet.model_dump(mode="json"), "traffic": self.trace_config,
                       "figures": self.profile.figures(fleet.model).model_dump(mode="json"),
                       "miss_budget": miss_budget})
        if self.cache and (cached := self.cache.get(name, key)) is not None:
            return cached
        with tqdm(total=round(self.trace.duration_s), desc=name, unit="sim s", leave=False) as bar:
            def progress(now: float) -> None:
                bar.update(min(round(now), bar.total) - bar.n)

            result = simulate(fleet, self.trace, self.profile, progress, miss_budget)
        figures = {"summary": summarize(result, fleet.slo_ttft_s, fleet.score_from_s),
                   "timeline": timeline(result, fleet.timeline_period_s),
                   "autoscaling": None if fleet.static_replicas else fleet.autoscaling.model_dump(mode="json")}
        return self.cache.put(name, key, figures) if self.cache else figures

    def static(self, variant: str, router: str, given: int | None = None) -> dict[str, Any]:
        """The smallest static fleet meeting the SLO, exact to the replica (or ``given``, unsearched)."""
        name, budget = label(variant, f"static/{router}"), self._budget(variant)
        if given is not None:
            best = self.run(f"{name} x{given}", self.fleet(variant, router, replicas=given))
            best["probes"] = f"given (static_fleets): x{given}, not searched"
            return best
        probes: dict[int, dict[str, Any]] = {}

        def passes(n: int) -> bool:
            if n not in probes:
                probes[n] = self.run(f"{name} x{n}", self.fleet(variant, router, replicas=n), budget)
                s = probes[n]["summary"]
                tqdm.write(f"{name} x{n}: " + ("over the miss budget, stopped" if s["stopped_early"] else
                                                f"attainment {s['feasible_slo_attainment']:.2%} of feasible requests"))
            return meets(probes[n]["summary"], self.attainment)

        cap = self.settings.autoscaling.max_replicas
        high = min(self.guess(variant), cap)
        while not passes(high) and high < cap:
            high = min(2 * high, cap)
        low = 0  # the largest size known to fail
        if passes(high):
            low = high // 2
            while low and passes(low):
                high, low = low, low // 2
            while high - low > 1:
                mid = (low + high) // 2
                if passes(mid):
                    high = mid
                else:
                    low = mid
        best = probes[high]
        if best["summary"]["stopped_early"]:  # even the largest fleet fails: run it through for its figures
            best = self.run(f"{name} x{high}", self.fleet(variant, router, replicas=high))
        best["probes"] = {n: "failed (stopped early)" if p["summary"]["stopped_early"] else
                          p["summary"]["feasible_slo_attainment"] for n, p in sorted(probes.items())}
        return best

    def guess(self, variant: str) -> int:
        """Replicas for the busiest minute's prompt tokens at the calibrated prefill rate, all uncached."""
        per_minute: dict[int, int] = {}
        for r in self.trace.requests:
            per_minute[int(r.arrival_s // 60)] = per_minute.get(int(r.arrival_s // 60), 0) + r.input_tokens
        return max(1, math.ceil(max(per_minute.values()) / 60 / self.profile.figures(variant).prefill_tokens_per_s))

    def serve_defaults(self, variant: str, router: str) -> dict[str, Any]:
        scaling = {"policy": "requests", "initial_replicas": None, **serve_autoscaling_defaults()}
        return self.run(label(variant, f"serve-defaults/{router}"), self.fleet(variant, router, autoscaling=scaling))

    def serve_tuned(self, variant: str, router: str) -> dict[str, Any]:
        """The best of the tuning search; ``search`` lists every candidate's figures."""
        defaults, budget = serve_autoscaling_defaults(), self._budget(variant)
        candidates = []
        for target in self.tuning.targets:
            for up, down in self.tuning.delays:
                scaling = {**defaults, "policy": "requests", "initial_replicas": None,
                           "target_ongoing_requests": target, "upscale_delay_s": up, "downscale_delay_s": down}
                name = label(variant, f"serve-tuned/{router} t{target:g} {up:g}-{down:g}s")
                run = self.run(name, self.fleet(variant, router, autoscaling=scaling), budget)
                candidates.append(({"target_ongoing_requests": target, "upscale_delay_s": up,
                                    "downscale_delay_s": down}, run))
        passing = [c for c in candidates if meets(c[1]["summary"], self.attainment)]
        if passing:
            options, best = min(passing, key=lambda c: c[1]["summary"]["replica_hours"])
        else:  # the most attainment; a candidate stopped early has its attainment so far
            options, best = max(candidates, key=lambda c: c[1]["summary"]["feasible_slo_attainment"])
        if best["summary"]["stopped_early"]:  # run it through for its figures
            scaling = {**defaults, "policy": "requests", "initial_replicas": None, **options}
            best = self.run(label(variant, f"serve-tuned/{router} t{options['target_ongoing_requests']:g} full"),
                            self.fleet(variant, router, autoscaling=scaling))
        best = dict(best)
        best["search"] = [{**o, "replica_hours": r["summary"]["replica_hours"], "stopped_early":
                           r["summary"]["stopped_early"], "feasible_slo_attainment":
                           r["summary"]["feasible_slo_attainment"], "meets_slo": meets(r["summary"], self.attainment)}
                          for o, r in candidates]
        return best

    def ours(self, variant: str, router: str) -> dict[str, Any]:
        scaling = {"policy": "prefill", "initial_replicas": None}
        return self.run(label(variant, f"prefill/{router}"), self.fleet(variant, router, autoscaling=scaling))

    def kind(self, variant: str, kind: FleetKind, given: int | None = None) -> dict[str, Any]:
        """The run of one report row."""
        if kind.policy == "static":
            return self.static(variant, kind.router, given)
        return {"serve-defaults": self.serve_defaults, "serve-tuned": self.serve_tuned,
                "prefill": self.ours}[kind.policy](variant, kind.router)
