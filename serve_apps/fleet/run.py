"""``swiftkv fleet simulate``: one fleet, its figures and its timeline written out."""

from __future__ import annotations

import json
from typing import Any

from tqdm import tqdm

from serve_apps.fleet.config import SimulateConfig
from serve_apps.fleet.plots import timeline_png
from serve_apps.fleet.profile import Profile
from serve_apps.fleet.results import summarize, timeline
from serve_apps.fleet.simulator import simulate
from swiftkv.outputs import write_files


def run_simulate(cfg: SimulateConfig, profile: Profile) -> dict[str, Any]:
    """Run the fleet; write ``results.json`` and ``timeline.png`` to ``cfg.out``; return the summary."""
    trace = cfg.traffic.build()
    fleet = cfg.fleet
    with tqdm(total=round(trace.duration_s), desc="simulated", unit="s") as bar:
        result = simulate(fleet, trace, profile, lambda now: bar.update(min(round(now), bar.total) - bar.n))
    summary = summarize(result, fleet.slo_ttft_s, fleet.score_from_s)
    rows = timeline(result, fleet.timeline_period_s)
    write_files(cfg.out, {
        "results.json": json.dumps({"config": cfg.model_dump(mode="json"), "summary": summary, "timeline": rows,
                                    "scale_events": result.scale_events}, indent=1).encode(),
        "timeline.png": timeline_png({fleet.model: rows}, fleet.slo_ttft_s),
    })
    return summary
