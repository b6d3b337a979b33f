"""The load test's report: a Markdown table per comparison and one figure."""

from __future__ import annotations

import statistics
from typing import Any

from swiftkv.outputs import figure_png

PANELS = ("swiftkv_vs_base", "serve_overhead", "router", "autoscaling")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms"


def _median(rounds: list[dict], variant: str, key) -> float:
    return statistics.median(key(r[variant]) for r in rounds)


def failed_requests(results: dict[str, Any]) -> int:
    total = 0
    for key in PANELS:
        for row in results.get(key, {}).get("rounds", []):
            total += sum(fig["all"]["failed"] if "all" in fig else fig["failed"] for fig in row.values())
    return total


def format_report(results: dict[str, Any]) -> str:
    cfg, lines = results["config"], ["# swiftkv load test", ""]
    if "swiftkv_vs_base" in results:
        res = results["swiftkv_vs_base"]
        lines += [f"## Base vs SwiftKV, one replica each ({cfg['heavy_requests']} x {cfg['heavy_input_len']}-token "
                  f"prompts, {cfg['heavy_output_len']} output tokens, {cfg['heavy_concurrency']} in flight)", "",
                  "| deployment | request throughput | TTFT p50 | TTFT p90 | TPOT p50 |", "|---|---:|---:|---:|---:|"]
        for name in ("base", "swiftkv"):
            rounds = res["rounds"]
            lines.append(f"| {name} | {_median(rounds, name, lambda s: s['request_throughput']):.2f} req/s | "
                         f"{_ms(_median(rounds, name, lambda s: s['ttft_s']['p50']))} | "
                         f"{_ms(_median(rounds, name, lambda s: s['ttft_s']['p90']))} | "
                         f"{_ms(_median(rounds, name, lambda s: s['tpot_s']['p50']))} |")
        lines += ["", f"SwiftKV / base: request throughput **{res['throughput_ratio']:.2f}x**, TTFT p50 "
                      f"{res['ttft_p50_ratio']:.2f}x, TPOT p50 {res['tpot_p50_ratio']:.2f}x (medians of per-round "
                      f"ratios, {len(res['rounds'])} rounds)", ""]
    if "serve_overhead" in results:
        res = results["serve_overhead"]
        lines += ["## SwiftKV through Serve vs vLLM's own OpenAI server (same engine options, same traffic)", "",
                  "| endpoint | request throughput | TTFT p50 |", "|---|---:|---:|"]
        for name in ("serve", "vllm"):
            lines.append(f"| {name} | {_median(res['rounds'], name, lambda s: s['request_throughput']):.2f} req/s | "
                         f"{_ms(_median(res['rounds'], name, lambda s: s['ttft_s']['p50']))} |")
        lines += ["", f"Serve / vLLM alone: throughput **{res['throughput_ratio']:.3f}x**, TTFT p50 "
                      f"**{res['ttft_p50_ratio']:.3f}x**", ""]
    if "router" in results:
        res = results["router"]
        lines += [f"## Prefill-aware router vs power-of-two, {cfg['router_replicas']} replicas each "
                  f"({cfg['mix_requests']} requests at {cfg['mix_rate']}/s, {cfg['mix_long_share']:.0%} of "
                  f"{cfg['mix_long_len']} -> {cfg['mix_long_output_len']} tokens, the rest "
                  f"{cfg['mix_short_len']} -> {cfg['mix_short_output_len']})", "",
                  "| router | short TTFT p50 | short TTFT p95 | long TTFT p95 | request throughput |",
                  "|---|---:|---:|---:|---:|"]
        for name in ("mix-prefill", "mix-pow2"):
            rounds = res["rounds"]
            lines.append(f"| {name.removeprefix('mix-')} | "
                         f"{_ms(_median(rounds, name, lambda s: s['short']['ttft_s']['p50']))} | "
                         f"{_ms(_median(rounds, name, lambda s: s['short']['ttft_s']['p95']))} | "
                         f"{_ms(_median(rounds, name, lambda s: s['long']['ttft_s']['p95']))} | "
                         f"{_median(rounds, name, lambda s: s['all']['request_throughput']):.2f} req/s |")
        lines += ["", f"prefill-aware / power-of-two: short-prompt TTFT p95 **{res['short_ttft_p95_ratio']:.2f}x** "
                      f"({1 - res['short_ttft_p95_ratio']:.0%} lower), long TTFT p95 "
                      f"{res['long_ttft_p95_ratio']:.2f}x", ""]
    if "autoscaling" in results:
        res = results["autoscaling"]
        lines += [f"## Prefill-aware vs request-count autoscaling on a burst ({cfg['burst_requests']} x "
                  f"{cfg['burst_input_len']} tokens at once; request policy target_ongoing_requests="
                  f"{res['requests_target']:g}; replica-seconds over {res['window_s']:.0f} s)", "",
                  "| policy | round | scale-up decision | replica-seconds | TTFT p95 | within the "
                  f"{res['ttft_budget_s']:g} s budget |", "|---|---:|---:|---:|---:|---|"]
        for i, row in enumerate(res["rounds"]):
            for name in ("burst-prefill", "burst-requests"):
                fig = row[name]
                decision = "never" if fig["scale_up_decision_s"] is None else f"{fig['scale_up_decision_s']:.1f} s"
                lines.append(f"| {name.removeprefix('burst-')} | {i} | {decision} | {fig['replica_seconds']:.0f} | "
                             f"{_ms(fig['ttft_s']['p95'])} | {'yes' if fig['ttft_p95_within_budget'] else 'no'} |")
        lines.append("")
    lines.append(f"Failed requests over the whole run: {failed_requests(results)}")
    return "\n".join(lines) + "\n"


def plot_png(results: dict[str, Any]) -> bytes:
    """One panel per comparison that ran, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in PANELS if k in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, key in zip(axes[0], panels, strict=True):
        res = results[key]
        if key == "swiftkv_vs_base":
            names = ["base", "swiftkv"]
            ax.bar(names, [_median(res["rounds"], n, lambda s: s["request_throughput"]) for n in names],
                   color=["grey", "tab:blue"])
            ax.set_ylabel("requests/s")
            ax.set_title(f"prefill-heavy: {res['throughput_ratio']:.2f}x")
        elif key == "serve_overhead":
            names = ["serve", "vllm"]
            ax.bar(names, [_median(res["rounds"], n, lambda s: s["ttft_s"]["p50"]) * 1e3 for n in names],
                   color=["tab:blue", "grey"])
            ax.set_ylabel("TTFT p50 (ms)")
            ax.set_title(f"Serve / vLLM: {res['ttft_p50_ratio']:.2f}x TTFT")
        elif key == "router":
            names = ["mix-prefill", "mix-pow2"]
            ax.bar([n.removeprefix("mix-") for n in names],
                   [_median(res["rounds"], n, lambda s: s["short"]["ttft_s"]["p95"]) * 1e3 for n in names],
                   color=["tab:blue", "grey"])
            ax.set_ylabel("short-prompt TTFT p95 (ms)")
            ax.set_title(f"router: {res['short_ttft_p95_ratio']:.2f}x")
        else:
            for name, color in (("burst-prefill", "tab:blue"), ("burst-requests", "grey")):
                points = res["rounds"][0][name]["replicas_over_time"]
                ax.step([t for t, _ in points], [n for _, n in points], where="post", color=color,
                        label=name.removeprefix("burst-"))
            ax.set_xlabel("seconds from the burst")
            ax.set_ylabel("replicas (incl. starting)")
            ax.set_title("burst: replicas over time (round 0)")
            ax.legend(fontsize=8)
    return figure_png(fig, dpi=110)
