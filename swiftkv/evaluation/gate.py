"""The quality gate: does a distilled SwiftKV model still read its prompt, and how much of the
rewiring's loss did distillation win back?

Lines, each PASS or FAIL, judged on one checkpoint (``model``):

- **retrieval at L tokens** (each of ``retrieval_lengths``): the share of needles it retrieves,
  against its base's share on the very same prompts (a SwiftKV checkpoint scores its own teacher):
  PASS when at least ``min_share`` of the base's.
- **recall across turns**: the same, over every gap of the multi-turn recall probe.
- **recovered share** (when the table has ``base`` and ``rewired`` columns): over the tasks where
  all three have scores, ``sum(model - rewired) / sum(base - rewired)``, with a 95% interval (delta
  method) from the question-by-question differences where the three scored the same questions, else
  from the tasks' standard errors: PASS when the estimate is at least ``min_recovered``. When the
  rewiring's own loss is not measurable (its 95% interval reaches zero) the share means nothing;
  the line then sets the model against the base instead: FAIL when it is below the base beyond its
  interval, else ``n/a`` (nothing to recover at these n).

The verdict is PASS only when every line that could be judged passes; a line without data says so.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field

from swiftkv.yaml_config import StrictConfig


class GateConfig(StrictConfig):
    """What the evaluation judges, and the bars."""

    model: str = "distilled"
    """The column (a key of ``models``) the gate judges."""

    base: str | None = "base"
    """The base model's column, for the recovered share (``null``: skip that line)."""

    rewired: str | None = "rewired"
    """The undistilled SwiftKV conversion's column, for the recovered share (``null``: skip it)."""

    retrieval_lengths: list[int] = Field(default=[512, 2048], min_length=1)
    """Prompt lengths of the needle probe that are judged (each must be among the probe's lengths)."""

    min_share: float = Field(default=0.9, gt=0, le=1)
    """Retrieval and recall must reach this share of the base's."""

    min_recovered: float = Field(default=0.5, ge=0, le=1)
    """The recovered share of the lm-eval tasks must reach this."""


def _share_line(name: str, exact: float, base: float, n: int, bar: float) -> dict[str, Any]:
    if base == 0:
        return {"line": name, "verdict": "n/a", "detail": f"the base retrieves none of {n}"}
    ratio = exact / base
    return {"line": name, "verdict": "PASS" if ratio >= bar else "FAIL", "value": ratio,
            "detail": f"{100 * exact:.0f}% vs the base's {100 * base:.0f}% (n={n}): {100 * ratio:.0f}% of the base's, "
                      f"bar {100 * bar:.0f}%"}


def recovered_share(quality: dict[str, dict[str, Any]], model: str, base: str, rewired: str) -> dict[str, Any] | None:
    """Over the tasks where the three columns have scores (``None`` when there is none):
    ``lost`` (``base - rewired``, summed over the tasks, with ``lost_low``/``lost_high``), ``gap``
    (``model - base``, likewise), ``tasks``, ``paired_tasks``, and ``share``/``low``/``high`` when the
    loss is measurable (its interval above zero), else ``share`` None."""
    rows = [parts for parts in quality.values() if all("score" in (parts.get(m) or {}) for m in (model, base, rewired))]
    if not rows:
        return None
    gained = sum(r[model]["score"] - r[rewired]["score"] for r in rows)
    lost = sum(r[base]["score"] - r[rewired]["score"] for r in rows)
    moments = [_paired_moments(r[model], r[base], r[rewired]) for r in rows]
    var_gained, var_lost, cov = (sum(m[i] for m in moments) for i in range(3))
    lost_spread = 1.96 * math.sqrt(var_lost)
    # model - base = gained - lost.
    gap_spread = 1.96 * math.sqrt(max(var_gained + var_lost - 2 * cov, 0.0))
    out = {"tasks": len(rows), "paired_tasks": sum(m[3] for m in moments), "share": None,
           "lost": lost, "lost_low": lost - lost_spread, "lost_high": lost + lost_spread,
           "gap": gained - lost, "gap_low": gained - lost - gap_spread, "gap_high": gained - lost + gap_spread}
    if out["lost_low"] <= 0:
        return out
    share = gained / lost
    # Var(a/b) ~ (Var a + share^2 Var b - 2 share Cov(a, b)) / b^2.
    spread = 1.96 * math.sqrt(max(var_gained + share**2 * var_lost - 2 * share * cov, 0.0)) / lost
    return {**out, "share": share, "low": share - spread, "high": share + spread}


def _paired_moments(model: dict[str, Any], base: dict[str, Any], rewired: dict[str, Any]
                    ) -> tuple[float, float, float, bool]:
    """``(Var gained, Var lost, Cov, paired)`` of one task's ``model - rewired`` and ``base - rewired``.
    Question by question when the three scored the same questions (``per_doc``): the three models'
    answers to one question are correlated, and pairing removes the spread between questions, which
    three independent standard errors count three times. Otherwise from the standard errors, the
    rewired scores shared by both differences."""
    docs = [part.get("per_doc") for part in (model, base, rewired)]
    n = len(docs[0] or [])
    if n > 1 and all(d is not None and len(d) == n for d in docs):
        gained = [m - r for m, r in zip(docs[0], docs[2], strict=True)]
        lost = [b - r for b, r in zip(docs[1], docs[2], strict=True)]
        mean_g, mean_l = sum(gained) / n, sum(lost) / n
        var_g = sum((g - mean_g) ** 2 for g in gained) / (n - 1)
        var_l = sum((x - mean_l) ** 2 for x in lost) / (n - 1)
        cov = sum((g - mean_g) * (x - mean_l) for g, x in zip(gained, lost, strict=True)) / (n - 1)
        return var_g / n, var_l / n, cov / n, True
    var_m, var_b, var_r = ((part.get("stderr") or 0.0) ** 2 for part in (model, base, rewired))
    return var_m + var_r, var_b + var_r, var_r, False


def _pairing(share: dict[str, Any]) -> str:
    if share["paired_tasks"] == share["tasks"]:
        return "paired by question"
    if share["paired_tasks"] == 0:
        return "from the tasks' standard errors"
    return f"paired by question on {share['paired_tasks']} of the tasks"


def _nothing_to_recover(share: dict[str, Any]) -> dict[str, Any]:
    """The recovered-share line when the rewiring's loss is within its noise: the model against the
    base, in points per task."""
    k = 100 / share["tasks"]
    below = share["gap_high"] < 0
    # No "value": on the other lines it is the figure set against the bar, and here there is no bar.
    return {"line": "recovered share", "verdict": "FAIL" if below else "n/a",
            "summary": f"no loss to recover; {share['gap'] * k:+.1f} points vs the base",
            "detail": f"no measurable loss to recover: the copy start is {share['lost'] * k:.1f} points per task "
                      f"below the base (95% CI {share['lost_low'] * k:.1f} to {share['lost_high'] * k:.1f}); "
                      f"this model {share['gap'] * k:+.1f} (95% CI {share['gap_low'] * k:+.1f} to "
                      f"{share['gap_high'] * k:+.1f}){', below the base' if below else ''}, {_pairing(share)}, "
                      f"over {share['tasks']} tasks"}


def judge(results: dict[str, Any], cfg: GateConfig) -> dict[str, Any]:
    """``{"verdict", "lines": [{"line", "verdict", "value", "detail"}]}`` for the evaluation's results."""
    from swiftkv.evaluation.answer_scoring import pool
    from swiftkv.evaluation.needle import by_length

    lines = []
    needle = results.get("long_context", {}).get(cfg.model)
    for length in cfg.retrieval_lengths:
        name = f"retrieval at {length} tokens"
        cell = by_length(needle).get(length) if needle and "cells" in needle else None
        lines.append(_share_line(name, cell["exact"], cell["base_exact"], cell["n"], cfg.min_share) if cell
                     else {"line": name, "verdict": "not run", "detail": "no needle probe at this length"})
    recall = (results.get("multi_turn", {}).get(cfg.model) or {}).get("recall")
    if recall:
        pooled = pool(recall["cells"])
        lines.append(_share_line("recall across turns", pooled["exact"], pooled["base_exact"], pooled["n"],
                                 cfg.min_share))
    else:
        lines.append({"line": "recall across turns", "verdict": "not run", "detail": "no multi-turn probe"})
    if cfg.base and cfg.rewired:
        share = recovered_share(results.get("quality", {}), cfg.model, cfg.base, cfg.rewired)
        if share is None:
            lines.append({"line": "recovered share", "verdict": "n/a",
                          "detail": "no task scored for all three models"})
        elif share["share"] is None:
            lines.append(_nothing_to_recover(share))
        else:
            summary = f"{share['share']:.2f} (95% CI {share['low']:.2f} to {share['high']:.2f}, {_pairing(share)})"
            lines.append({"line": "recovered share", "value": share["share"],
                          "verdict": "PASS" if share["share"] >= cfg.min_recovered else "FAIL", "summary": summary,
                          "detail": f"{summary} over {share['tasks']} tasks, bar {cfg.min_recovered:.2f}"})
    judged = [line["verdict"] for line in lines if line["verdict"] in ("PASS", "FAIL")]
    verdict = "PASS" if judged and all(v == "PASS" for v in judged) else "FAIL"
    return {"model": cfg.model, "verdict": verdict, "lines": lines}


def format_gate(gate: dict[str, Any]) -> str:
    """The gate as a markdown table, the verdict first."""
    lines = [f"**Quality gate for `{gate['model']}`: {gate['verdict']}**", "", "| check | verdict | measured |",
             "|---|---|---|"]
    lines += [f"| {line['line']} | {line['verdict']} | {line['detail']} |" for line in gate["lines"]]
    return "\n".join(lines)
