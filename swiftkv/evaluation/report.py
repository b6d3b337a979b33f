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


def _usable(parts: dict[str, Any]) -> dict[str, Any]:
    return {m: r for m, r in parts.items() if "error" not in r}


def _retrieval_cell(cell: dict[str, Any]) -> str:
    """``exact% (base exact%), log-prob difference ± its standard error``."""
    return (f"{100 * cell['exact']:.0f}% ({100 * cell['base_exact']:.0f}%), "
            f"{cell['delta']:+.2f} ± {cell['delta_stderr']:.2f}")


def format_long_context(parts: dict[str, Any]) -> str:
    """Needles retrieved by prompt length (over every depth), one column per model: the model's
    share, its base's on the same prompts, and the answer's log-probability, model minus base."""
    from swiftkv.evaluation.needle import by_length

    by_model = {m: by_length(r) for m, r in _usable(parts).items()}
    if not by_model:
        return ""
    lengths = sorted({x for cells in by_model.values() for x in cells})
    lines = ["| prompt tokens | " + " | ".join(by_model) + " |", "|---:|" + "---:|" * len(by_model)]
    for x in lengths:
        cells = [f"{_retrieval_cell(c[x])} (n={c[x]['n']})" if x in c else "-" for c in by_model.values()]
        lines.append(f"| {x} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_multi_turn(parts: dict[str, Any]) -> str:
    """Teacher agreement by assistant turn (SwiftKV models) and recall by gap (every model)."""
    usable = _usable(parts)
    lines = []
    for data in ("chitchat", "mtbench"):
        rows = {m: r[data] for m, r in usable.items() if data in r}
        if rows:
            turns = len(next(iter(rows.values()))["kl"])
            lines += [f"Agreement with the teacher by assistant turn, {data} "
                      f"(KL per token / top-1 teacher-forced / greedy reply equal):", "",
                      "| model | " + " | ".join(f"turn {k}" for k in range(1, turns + 1)) + " |",
                      "|---|" + "---:|" * turns]
            for m, r in rows.items():
                cells = [f"{r['kl'][k]:.3f} / {r['top1'][k]:.2f} / {r['greedy_match'][k]:.2f}" for k in range(turns)]
                lines.append(f"| {m} (n={r['n']}) | " + " | ".join(cells) + " |")
            lines.append("")
    recalls = {m: r["recall"] for m, r in usable.items() if "recall" in r}
    if recalls:
        gaps = next(iter(recalls.values()))["gaps"]
        lines += ["Recall of a fact stated in the first turn, by turns in between (recalled, the base's share, "
                  "answer log-prob model minus base ± s.e.):", "",
                  "| model | " + " | ".join(f"{g} turns" for g in gaps) + " |", "|---|" + "---:|" * len(gaps)]
        lines += [f"| {m} (n={r['n']} each) | " + " | ".join(_retrieval_cell(c) for c in r["cells"]) + " |"
                  for m, r in recalls.items()]
    return "\n".join(lines)


def format_report(results: dict[str, Any]) -> str:
    """The benchmark table, then the long-context and multi-turn tables where they were run."""
    sections = [format_table(results)]
    if long_context := format_long_context(results.get("long_context", {})):
        sections.append("Needle retrieval by prompt length, over every depth (retrieved, the base's share on the "
                        "same prompts, answer log-prob model minus base ± s.e.):\n\n" + long_context)
    if multi_turn := format_multi_turn(results.get("multi_turn", {})):
        sections.append(multi_turn)
    return "\n\n".join(sections)


def plot_quality(results: dict[str, Any]) -> bytes:
    """Bars of each task's score per model with standard-error whiskers, PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from swiftkv.outputs import figure_png

    models = list(results["models"])
    tasks = [t for t in results["tasks"] if any("score" in (results["quality"][t].get(m) or {}) for m in models)]
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(tasks) + 2), 3.8))
    width = 0.8 / len(models)
    for i, model in enumerate(models):
        parts = [results["quality"][t].get(model) or {} for t in tasks]
        ax.bar([x + i * width for x in range(len(tasks))], [100 * (p.get("score") or 0) for p in parts], width,
               yerr=[100 * (p.get("stderr") or 0) for p in parts], capsize=3, label=model)
    ax.set_xticks([x + width * (len(models) - 1) / 2 for x in range(len(tasks))], tasks, rotation=20)
    ax.set_ylabel("score (%)")
    ax.legend(fontsize=8)
    return figure_png(fig)
