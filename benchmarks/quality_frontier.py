"""The quality frontier: what each cutoff keeps, after the shipped recipe, beside the baseline that
drops the same layers outright.

    python -m benchmarks.quality_frontier                       # the SmolLM2 CPU frontier (hours on 2 cores)
    python -m benchmarks.quality_frontier --set 'cutoffs=[15, 25]' --set drop_baseline=false

For every cutoff ``c``: the recipe distilled at ``c`` (``ray_jobs.distill``; its least-squares start's
held-out R² is the ceiling of a linear K/V at that cutoff) and, with ``drop_baseline``, the base cut to
its first ``c`` layers and healed on the same data and steps (``benchmarks.drop_layers``). Then one
evaluation of all of them and the base (``ray_jobs.evaluate``: needle retrieval, recall across turns,
lm-eval), and ``frontier.json``, ``frontier.md`` (the table) and ``frontier.png`` (the plot) under
``out``. Every run is kept: a rerun trains only what is missing and the evaluation reuses its parts.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from pydantic import Field

from swiftkv.yaml_config import StrictConfig, job_main

log = logging.getLogger("benchmarks.quality_frontier")


class FrontierConfig(StrictConfig):
    recipe: str = "ray_jobs/configs/smollm2-135m-cpu.yaml"
    """The distillation recipe every cutoff (and the baseline) trains with."""

    recipe_overrides: list[str] = []
    """``key=value`` overrides of the recipe (``train.max_steps=40``)."""

    cutoffs: list[int] = Field(default=[15, 18, 20, 23, 25], min_length=1)
    """Cutoffs c (layers keeping their own KV)."""

    drop_baseline: bool = True
    """Also train and evaluate the base cut to its first c layers (``benchmarks.drop_layers``)."""

    evaluate: str = "ray_jobs/configs/eval-frontier-smollm2-cpu.yaml"
    """The evaluation config; the frontier sets its models and output folder."""

    evaluate_overrides: list[str] = []
    """``key=value`` overrides of the evaluation config."""

    out: str = "artifacts/frontier"
    """Output folder: ``swiftkv-c<c>/`` and ``drop-c<c>/`` runs, ``eval/``, the table and the plot."""


TOKEN_SHIFT = "swiftkv + token shift"
SWIFTKV_METHODS = ("swiftkv", TOKEN_SHIFT)
"""A distilled SwiftKV row's method: as published, or with the recipe's token shift."""


def _method(recipe) -> dict[str, Any]:
    """A distilled run's method, and its token shift when the recipe has one."""
    shift = recipe.token_shift
    if not shift.layers:
        return {"method": "swiftkv"}
    return {"method": TOKEN_SHIFT, "token_shift": {"layers": shift.layers, "tokens": shift.tokens}}


def row_label(row: dict[str, Any]) -> str:
    """The model's name in the tables, with its token shift when it has one (a shifted run shares
    its folder name, ``swiftkv-c<c>``, with the plain one)."""
    shift = row.get("token_shift")
    if not shift:
        return row["model"]
    layers = ", ".join(str(j) for j in shift["layers"])
    return f"{row['model']} + token shift (layers {layers}, {shift['tokens']} before)"


def _init_fit(run_dir: Path) -> dict[str, float]:
    """The least-squares start's R² summary of a distillation run, if it had one."""
    from swiftkv.distill.model_io import INIT_FIT

    fits = sorted(run_dir.glob(f"student-init-ls-*/{INIT_FIT}"))
    if not fits:
        return {}
    fit = json.loads(fits[-1].read_text())
    return {k: v for k, v in fit.items() if k.endswith(("_least_squares", "_before"))}


def train_all(cfg: FrontierConfig, out: Path) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """``(models, facts)``: the evaluation's model references and, per model, its cutoff, method and
    fit figures; trains what is not there yet."""
    from benchmarks.drop_layers import train_drop_baseline
    from ray_jobs.distill import run as run_distill
    from swiftkv.convert import convert_checkpoint
    from swiftkv.distill.config import load_config
    from swiftkv.distill.train_loop import MODEL_DIR
    from swiftkv.model_source import resolve_model

    recipe = load_config(cfg.recipe, [*cfg.recipe_overrides, f"output.storage_path={out}"])
    models = {"base": recipe.model}
    facts: dict[str, dict[str, Any]] = {"base": {"method": "base", "cutoff": None}}
    for c in cfg.cutoffs:
        name = f"swiftkv-c{c}"
        checkpoint = sorted((out / name).glob(f"step_*/{MODEL_DIR}/config.json"))
        if not checkpoint:
            log.info("distilling at c = %d", c)
            run_distill(recipe.model_copy(update={"num_key_value_layers": c,
                                                  "output": recipe.output.model_copy(update={"name": name})}))
            checkpoint = sorted((out / name).glob(f"step_*/{MODEL_DIR}/config.json"))
        models[name] = str(checkpoint[-1].parent)
        facts[name] = {**_method(recipe), "cutoff": c, **_init_fit(out / name)}
        # The paper's rewired model (the copy start, undistilled): the gate's recovered share needs it.
        rewired = out / f"rewired-c{c}"
        if not (rewired / "config.json").is_file():
            convert_checkpoint(resolve_model(recipe.model), rewired, num_key_value_layers=c,
                               key_value_group_size=recipe.key_value_group_size)
        models[rewired.name] = str(rewired)
        facts[rewired.name] = {"method": "rewired", "cutoff": c}
        if cfg.drop_baseline:
            name = f"drop-c{c}"
            if not (out / name / "model" / "config.json").is_file():
                log.info("training the drop-layers baseline at c = %d", c)
                train_drop_baseline(recipe, c, out / name)
            models[name] = str(out / name / "model")
            facts[name] = {"method": "drop layers", "cutoff": c,
                           **json.loads((out / name / "figures.json").read_text())}
            facts[name].pop("curve")
    layers = _num_layers(resolve_model(recipe.model))
    for fact in facts.values():
        fact["prefill_saving"] = 0.0 if fact["cutoff"] is None else (layers - fact["cutoff"]) / layers
    return models, facts


def _num_layers(path: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).num_hidden_layers


def frontier_rows(results: dict[str, Any], facts: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per model: its facts, retrieval by length, recall, each lm-eval task's score, and for
    a SwiftKV model the quality gate (its base and its copy start, ``rewired-c<c>``, beside it)."""
    from swiftkv.evaluation.answer_scoring import pool
    from swiftkv.evaluation.gate import GateConfig, judge
    from swiftkv.evaluation.needle import by_length

    paired = next((m for m, fact in facts.items() if fact["method"] in SWIFTKV_METHODS
                   and "cells" in results["long_context"].get(m, {})), None)
    rows = []
    for model, fact in facts.items():
        row = dict(fact, model=model)
        needle = results["long_context"].get(model, {})
        recall = (results["multi_turn"].get(model) or {}).get("recall")
        if fact["method"] == "drop layers" and paired is not None:
            # A plain checkpoint is its own probe's base: score it against the real base's answers on
            # the same prompts, which every SwiftKV model's probe holds.
            needle = {**needle, "cells": _against_base(needle.get("cells"), results["long_context"][paired]["cells"])}
            base_recall = (results["multi_turn"].get(paired) or {}).get("recall")
            if recall and base_recall:
                recall = {**recall, "cells": _against_base(recall["cells"], base_recall["cells"])}
        if needle.get("cells"):
            row["retrieval"] = {str(length): cell for length, cell in by_length(needle).items()}
        if recall:
            row["recall"] = pool(recall["cells"])
        row["tasks"] = {task: parts[model] for task, parts in results["quality"].items()
                        if "score" in (parts.get(model) or {})}
        if fact["method"] in SWIFTKV_METHODS:
            lengths = [int(x) for x in row.get("retrieval", {})]
            gate = GateConfig(model=model, base="base", rewired=f"rewired-c{fact['cutoff']}",
                              retrieval_lengths=[x for x in lengths if x <= 2048] or [512, 2048])
            row["gate"] = judge(results, gate)
        rows.append(row)
    _base_from_pairs(rows)
    return rows


def _against_base(cells: list[dict[str, Any]] | None, paired: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """``cells`` of a model probed alone, with the base's share and answer log-prob taken from a
    SwiftKV model's cells on the same prompts (same length and depth, or gap). The difference's
    standard error needs the prompts paired one by one, which the cells do not keep: NaN."""
    if not cells:
        return cells
    key = [k for k in ("length", "depth", "gap") if k in cells[0]]
    base = {tuple(c[k] for k in key): c for c in paired}
    out = []
    for cell in cells:
        ref = base[tuple(cell[k] for k in key)]
        out.append({**cell, "base_exact": ref["base_exact"], "base_logprob": ref["base_logprob"],
                    "delta": cell["logprob"] - ref["base_logprob"], "delta_stderr": math.nan})
    return out


def _base_from_pairs(rows: list[dict[str, Any]]) -> None:
    """The base's retrieval and recall when it was not probed itself: every SwiftKV model's probe
    scores the base on the same prompts (the first SwiftKV row's figures, with a difference of 0)."""
    base = next(r for r in rows if r["method"] == "base")
    paired = next((r for r in rows if r["method"] in SWIFTKV_METHODS and "retrieval" in r), None)
    if paired is None or "retrieval" in base:
        return

    def as_base(cell: dict[str, float]) -> dict[str, float]:
        return {**cell, "exact": cell["base_exact"], "delta": 0.0, "delta_stderr": 0.0}

    base["retrieval"] = {x: as_base(cell) for x, cell in paired["retrieval"].items()}
    if "recall" in paired:
        base["recall"] = as_base(paired["recall"])


def format_frontier(rows: list[dict[str, Any]]) -> str:
    """The markdown table: a row per model, retrieval and recall as the share retrieved (the answer's
    log-prob against the base's on the same prompts), the tasks as score ± standard error."""
    lengths = sorted({int(x) for r in rows for x in r.get("retrieval", {})})
    tasks = list(dict.fromkeys(t for r in rows for t in r["tasks"]))
    head = ["model", "prefill saved", "K / V R² (linear ceiling)"] + [f"retrieval {x}" for x in lengths]
    head += ["recall"] + tasks + ["gate (recovered share, 95% CI)"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        r2 = (f"{r['k_r2_least_squares']:.2f} / {r['v_r2_least_squares']:.2f}" if "k_r2_least_squares" in r else "-")
        cells = [row_label(r), f"{100 * r['prefill_saving']:.0f}%", r2]
        for x in lengths:
            cell = r.get("retrieval", {}).get(str(x))
            cells.append(f"{100 * cell['exact']:.0f}% ({cell['delta']:+.1f})" if cell else "-")
        rec = r.get("recall")
        cells.append(f"{100 * rec['exact']:.0f}% ({rec['delta']:+.1f})" if rec else "-")
        for task in tasks:
            part = r["tasks"].get(task)
            cells.append(f"{100 * part['score']:.1f} ± {100 * part['stderr']:.1f}" if part else "-")
        cells.append(_gate_cell(r["gate"]) if "gate" in r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    n = next((r["retrieval"][str(lengths[0])]["n"] for r in rows if r.get("retrieval")), 0) if lengths else 0
    rec_n = next((r["recall"]["n"] for r in rows if r.get("recall")), 0)
    task_n = next((p["n"] for r in rows for p in r["tasks"].values()), 0)
    lines += ["", f"Retrieval: share of needles retrieved (n = {n} per length), in brackets the answer's log-prob "
              f"minus the base's on the same prompts; recall: n = {rec_n} conversations; tasks: n = {task_n} each, "
              "0-shot, acc_norm; gate: retrieval at up to 2,048 tokens and recall >= 90% of the base's, recovered "
              "share (against the undistilled copy start, `rewired-c<c>`) >= 0.5."]
    return "\n".join(lines)


def _gate_cell(gate: dict[str, Any]) -> str:
    share = next((line for line in gate["lines"] if line["line"] == "recovered share"), None)
    return f"**{gate['verdict']}** ({share.get('summary', 'n/a') if share else 'n/a'})"


def plot_frontier(rows: list[dict[str, Any]]) -> bytes:
    """Retrieval at each length, recall and the mean task score against the prefill saved, SwiftKV
    beside the drop-layers baseline, the base as a line. PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from swiftkv.outputs import figure_png

    base = next(r for r in rows if r["method"] == "base")
    lengths = sorted({int(x) for r in rows for x in r.get("retrieval", {})})
    panels = [(f"retrieval at {x:,} tokens", lambda r, x=x: r.get("retrieval", {}).get(str(x), {}).get("exact"))
              for x in lengths]
    panels += [("recall across turns", lambda r: (r.get("recall") or {}).get("exact")),
              ("mean task score", lambda r: sum(p["score"] for p in r["tasks"].values()) / len(r["tasks"])
               if r["tasks"] else None)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))  # recall and tasks: two at least
    for ax, (title, value) in zip(axes, panels, strict=True):
        for method, style in (("swiftkv", "-o"), (TOKEN_SHIFT, ":^"), ("drop layers", "--s")):
            points = sorted((100 * r["prefill_saving"], value(r)) for r in rows
                            if r["method"] == method and value(r) is not None)
            if points:
                ax.plot(*zip(*points, strict=True), style, label=method)
        if value(base) is not None:
            ax.axhline(value(base), color="grey", lw=1, label="base")
        ax.set(title=title, xlabel="prefill saved (%)")
        ax.legend(fontsize=8)
    return figure_png(fig)


def run(cfg: FrontierConfig) -> dict[str, Any]:
    from ray_jobs.evaluate import run as run_evaluate
    from swiftkv.evaluation.config import EvalConfig
    from swiftkv.outputs import write_files
    from swiftkv.yaml_config import load_config

    out = Path(cfg.out).resolve()
    evaluation = load_config(EvalConfig, cfg.evaluate, cfg.evaluate_overrides, "evaluation config")
    models, facts = train_all(cfg, out)
    # The probes run on the trained models; each scores its base on the same prompts beside it.
    probed = [m for m, fact in facts.items() if fact["method"] in (*SWIFTKV_METHODS, "drop layers")]
    evaluation = EvalConfig.model_validate({**evaluation.model_dump(), "models": models, "out": str(out / "eval"),
                                            "probe_models": evaluation.probe_models or probed})
    results = run_evaluate(evaluation)
    rows = frontier_rows(results, facts)
    table = format_frontier(rows)
    write_files(str(out), {"frontier.json": json.dumps({"rows": rows, "config": cfg.model_dump()}, indent=1).encode(),
                           "frontier.md": (table + "\n").encode(), "frontier.png": plot_frontier(rows)})
    print(table)
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    return job_main("python -m benchmarks.quality_frontier", __doc__.split("\n\n")[0], FrontierConfig, run, argv,
                    what="frontier config", config_help="YAML config (default: every field's default)")


if __name__ == "__main__":
    sys.exit(main())
