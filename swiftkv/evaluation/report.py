"""The evaluation's paper-style table: each task and the average, score +- standard error (n)."""

from __future__ import annotations

import statistics
from typing import Any


def _cell(part: dict[str, Any] | None) -> str:
    if part is None:
        return "not run"
    if "unavailable" in part:
        return "unavailable"
    if "error" in part:
        return "failed"
    score, stderr = 100 * part["score"], part["stderr"]
    spread = f" ± {100 * stderr:.1f}" if stderr is not None else ""
    return f"{score:.1f}{spread} (n={part['n']})"


def average(results: dict[str, Any], model: str) -> float | None:
    """Mean score over the tasks every model has a score for (so the columns average the same rows)."""
    rows = [t for t in results["tasks"]
            if all("score" in (results["quality"][t].get(m) or {}) for m in results["models"])]
    if not rows:
        return None
    return statistics.fmean(results["quality"][t][model]["score"] for t in rows)


def format_table(results: dict[str, Any]) -> str:
    """Markdown: one row per task (``task name, n-shot, metric``), one column per model."""
    models = list(results["models"])
    lines = ["| task | " + " | ".join(models) + " |", "|---|" + "---:|" * len(models)]
    for name in results["tasks"]:
        spec = results["task_specs"][name]
        label = f"{name} ({spec['num_fewshot']}-shot, {spec['metric']})"
        lines.append(f"| {label} | " + " | ".join(_cell(results["quality"][name].get(m)) for m in models) + " |")
    means = [average(results, m) for m in models]
    lines.append("| **average** | " + " | ".join("-" if v is None else f"**{100 * v:.1f}**" for v in means) + " |")
    notes = [f"- {name} / {m}: {part['error']}" for name in results["tasks"]
             for m, part in results["quality"][name].items() if part and "error" in part]
    return "\n".join(lines + ([""] + notes if notes else []))
