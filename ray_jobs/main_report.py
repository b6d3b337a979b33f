"""The main job's ``report.json`` and ``report.md`` (the figures, the tables and links to the plots)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from swiftkv.evaluation.gate import format_gate
from swiftkv.evaluation.report import format_report

PLOTS = [("SimScore of the base model", "simscore/simscore.png"),
         ("quality, base / rewired / distilled", "eval/quality.png"),
         ("needle retrieval by length and depth", "eval/needle.png"),
         ("agreement and recall by turn", "eval/multiturn.png"),
         ("vLLM throughput vs base", "bench/throughput_ratio.png")]


def _benchmark_lines(bench: dict[str, Any]) -> list[str]:
    lines = []
    for row in bench["throughput_tok_s"]:
        ratios = [f"{name.removesuffix(' / base')} {value:.2f}x" for name, value in row.items()
                  if name.endswith(" / base") and not name.startswith("base")]
        lines.append(f"- prefill-heavy throughput ({row['cell']} tokens): " + ", ".join(ratios) + " the base")
    lat = {name: f"{v['ttft_ratio']:.2f}x" for name, v in bench["latency"].items() if name != "base"}
    lines.append("- TTFT at a fixed rate vs the base: " + ", ".join(f"{n} {r}" for n, r in lat.items()))
    return lines


def write_report(report: dict[str, Any], evaluation: dict[str, Any], out: Path) -> Path:
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    d, cut = report["distill"], report["cutoff"]
    lines = ["# swiftkv main job" + (" (quick)" if report["quick"] else ""), ""]
    if "gate" in evaluation:  # the first screen: does the distilled model still read its prompt?
        lines += [format_gate(evaluation["gate"]), ""]
    lines += [f"- base model: `{report['base_model']}` ({report['num_layers']} layers); cutoff c = "
             f"{cut['num_key_value_layers']} ({cut['source']}; SimScore recommends "
             f"{cut['simscore_recommended']}), AcrossKV g = {report['key_value_group_size']}",
             f"- distillation: {d['steps']} steps; held-out KL {d['heldout_kl_at_start']:.4f} -> "
             f"{d['heldout_kl']:.4f} ({d['heldout_kl'] / d['heldout_kl_at_start']:.2f}x), top-1 agreement "
             f"{d['heldout_top1_at_start']:.3f} -> {d['heldout_top1']:.3f}",
             f"- checkpoint: `{report['checkpoint']}`", *_benchmark_lines(report["prefill_benchmark"])]
    if "serve" in report:
        s = report["serve"]
        lines.append(f"- `swiftkv serve` ready in {s['ready_s']:.0f} s (models {', '.join(s['models'])}); the served "
                     f"SwiftKV model's greedy answers equal the HF student's on {s['swiftkv_matches_hf_student']}; "
                     f"stopped with exit code {s['exit_code']}")
    lines.append("- seconds per step: " + ", ".join(f"{k} {v:.0f}" for k, v in report["seconds"].items()))
    lines += ["", "## Quality", "", format_report(evaluation), "", "## Answers", ""]
    columns = list(report["answers"])
    lines += ["| prompt | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for i, prompt in enumerate(report["prompts"]):
        lines.append(f"| {prompt} | " + " | ".join(report["answers"][k][i].replace("\n", " ") for k in columns) + " |")
    lines += ["", "## Plots", ""] + [f"![{title}]({path})" for title, path in PLOTS if (out / path).is_file()]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
