"""The fleet's figures: the replicas/TTFT timeline of runs, and the validation's TTFTs over the host's CPUs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from swiftkv.outputs import figure_png

if TYPE_CHECKING:
    from serve_apps.fleet.host_load import HostSample


def timeline_png(timelines: dict[str, list[dict[str, float]]], slo_ttft_s: float) -> bytes:
    """Replicas (top) and the TTFT p90 of each period's arrivals (bottom, log scale) over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for label, rows in timelines.items():
        minutes = [row["t"] / 60 for row in rows]
        top.step(minutes, [row["replicas"] for row in rows], where="post", label=label)
        bottom.plot(minutes, [row["ttft_p90_s"] for row in rows], label=label, linewidth=1)
    bottom.axhline(slo_ttft_s, color="black", linestyle="--", linewidth=0.8, label="SLO")
    top.set_ylabel("replicas (incl. starting, draining)")
    bottom.set_ylabel("TTFT p90 of arrivals (s)")
    bottom.set_yscale("log")
    bottom.set_xlabel("minutes")
    top.legend(fontsize=8)
    bottom.legend(fontsize=8)
    return figure_png(fig, dpi=110)


def validation_png(per_request: list[dict], host: list[HostSample]) -> bytes:
    """Each request's measured and simulated TTFT against its send time (top; a repeated replay's
    passes one after another), and who had the host's CPUs meanwhile (bottom, stacked cores: the
    engines, the rest of this run, other processes, steal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, height_ratios=(2, 1))
    sent = [r["sent_s"] + r.get("pass_start_s", 0.0) for r in per_request]
    top.scatter(sent, [r["ttft_s"] if r["ttft_s"] is not None else float("nan") for r in per_request],
                s=10, label="measured")
    top.scatter(sent, [r["simulated_ttft_s"] for r in per_request], s=10, marker="x", label="simulated")
    top.set_ylabel("TTFT (s)")
    top.legend(fontsize=8)
    if host:
        t = [s.t for s in host]
        bottom.stackplot(t, [s.engines for s in host], [s.ours - s.engines for s in host],
                         [s.others for s in host], [s.steal for s in host],
                         labels=["vLLM engines", "rest of this run", "other processes", "steal"], step="pre")
        bottom.legend(fontsize=8, loc="upper right")
    bottom.set_ylabel("host cores")
    bottom.set_xlabel("seconds into the replay (its passes in turn)")
    return figure_png(fig, dpi=110)
