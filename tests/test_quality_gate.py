"""The quality gate (swiftkv/evaluation/gate.py) and the model card it writes into: PASS/FAIL per
line from the evaluation's results, the recovered share with its interval, and the card's gate
section replaced in place."""

from __future__ import annotations

import pytest

from swiftkv.evaluation.gate import GateConfig, format_gate, judge, recovered_share
from swiftkv.model_card import NO_GATE, card_text, write_gate
from tests.tiny import tiny_config


def _cell(length: int, exact: float, base: float, n: int = 20) -> dict:
    return {"length": length, "depth": 0.5, "n": n, "exact": exact, "base_exact": base, "logprob": -1.0,
            "base_logprob": -0.5, "delta": -0.5, "delta_stderr": 0.1}


def _results(retrieval_512: float, recall: float) -> dict:
    return {
        "long_context": {"distilled": {"cells": [_cell(512, retrieval_512, 1.0), _cell(2048, 0.95, 1.0)]}},
        "multi_turn": {"distilled": {"recall": {"gaps": [0, 4], "cells": [
            {"gap": 0, **_cell(0, recall, 1.0)}, {"gap": 4, **_cell(0, recall, 1.0)}]}}},
        "quality": {"ARC-Easy": {"base": {"score": 0.60, "stderr": 0.02}, "rewired": {"score": 0.40, "stderr": 0.02},
                                 "distilled": {"score": 0.55, "stderr": 0.02}},
                    "PIQA": {"base": {"score": 0.70, "stderr": 0.01}, "rewired": {"score": 0.60, "stderr": 0.01},
                             "distilled": {"score": 0.62, "stderr": 0.01}}},
    }


def test_every_line_passes_or_the_verdict_fails():
    gate = judge(_results(0.9, 0.95), GateConfig())
    assert gate["verdict"] == "PASS" and [line["verdict"] for line in gate["lines"]] == ["PASS"] * 4
    assert gate["lines"][3]["value"] == pytest.approx((0.15 + 0.02) / (0.20 + 0.10))
    failed = judge(_results(0.85, 0.95), GateConfig())
    assert failed["verdict"] == "FAIL" and failed["lines"][0]["verdict"] == "FAIL"
    assert "85% vs the base's 100% (n=20)" in failed["lines"][0]["detail"]
    text = format_gate(failed)
    assert text.startswith("**Quality gate for `distilled`: FAIL**") and "| retrieval at 512 tokens | FAIL |" in text


def test_missing_probes_are_said_and_never_pass():
    gate = judge({"long_context": {}, "multi_turn": {}, "quality": {}}, GateConfig())
    assert gate["verdict"] == "FAIL"
    assert [line["verdict"] for line in gate["lines"]] == ["not run", "not run", "not run", "n/a"]


def test_recovered_share_interval_widens_with_the_errors():
    quality = _results(1, 1)["quality"]
    tight = recovered_share(quality, "distilled", "base", "rewired")
    for parts in quality.values():
        for part in parts.values():
            part["stderr"] *= 3
    wide = recovered_share(quality, "distilled", "base", "rewired")
    assert tight["share"] == pytest.approx(wide["share"]) and tight["low"] < tight["share"] < tight["high"]
    assert wide["high"] - wide["low"] == pytest.approx(3 * (tight["high"] - tight["low"]))
    for parts in quality.values():  # the rewiring lost nothing: no share to speak of
        parts["rewired"]["score"] = parts["base"]["score"]
    assert recovered_share(quality, "distilled", "base", "rewired")["share"] is None


def test_a_rewiring_that_loses_nothing_measurable_sets_the_model_against_the_base():
    """The copy start 1 point below the base on each task, within the tasks' noise: a share of that
    loss means nothing (it came out -0.75, 95% CI -6 to 5, on a real run at c = 23). The line then
    asks whether the model is below the base beyond its interval: n/a when not, FAIL when so."""
    quality = {task: {"base": {"score": 0.60, "stderr": 0.05}, "rewired": {"score": 0.59, "stderr": 0.05},
                      "distilled": {"score": 0.595, "stderr": 0.05}} for task in ("ARC-Easy", "PIQA")}
    share = recovered_share(quality, "distilled", "base", "rewired")
    assert share["share"] is None and share["lost_low"] < 0 < share["lost"] == pytest.approx(0.02)
    line = judge({"quality": quality}, GateConfig())["lines"][3]
    assert line["verdict"] == "n/a" and "value" not in line
    assert line["summary"] == "no loss to recover; -0.5 points vs the base"
    assert line["detail"].startswith("no measurable loss to recover: the copy start is 1.0 points per task below")
    for parts in quality.values():  # now the distilled model falls 30 points below the base
        parts["distilled"]["score"] = 0.30
    gate = judge({"quality": quality}, GateConfig())
    assert gate["lines"][3]["verdict"] == "FAIL" and "below the base" in gate["lines"][3]["detail"]
    assert gate["verdict"] == "FAIL"


def test_recovered_share_is_paired_by_question_when_the_three_scored_the_same_questions():
    """200 questions: the rewired model gets the first 80 right, the base 120, the student 110 (the
    rewired's and 30 of the 40 the base adds): pairing counts only the questions where they differ.
    The interval is the delta method's over those paired differences, and far narrower than three
    independent standard errors give."""
    n = 200
    docs = {"rewired": [1.0] * 80 + [0.0] * 120, "base": [1.0] * 120 + [0.0] * 80,
            "distilled": [1.0] * 110 + [0.0] * 90}
    quality = {"ARC-Easy": {m: {"score": sum(d) / n, "stderr": (sum(d) / n * (1 - sum(d) / n) / (n - 1)) ** 0.5,
                                "per_doc": d} for m, d in docs.items()}}
    paired = recovered_share(quality, "distilled", "base", "rewired")
    assert paired["share"] == pytest.approx(0.75) and paired["paired_tasks"] == 1
    # By hand: gained g_i = d_i - r_i (30 ones), lost l_i = b_i - r_i (40 ones), g_i = 1 implies l_i = 1.
    var_g, var_l = (30 * 170 / n) / (n - 1) / n, (40 * 160 / n) / (n - 1) / n
    cov = (30 - 30 * 40 / n) / (n - 1) / n
    spread = 1.96 * (var_g + 0.75**2 * var_l - 2 * 0.75 * cov) ** 0.5 / 0.2
    assert paired["high"] - paired["share"] == pytest.approx(spread)
    for part in quality["ARC-Easy"].values():
        del part["per_doc"]
    unpaired = recovered_share(quality, "distilled", "base", "rewired")
    assert unpaired["share"] == pytest.approx(0.75) and unpaired["paired_tasks"] == 0
    assert paired["high"] - paired["low"] < 0.5 * (unpaired["high"] - unpaired["low"])
    line = judge({"quality": {"ARC-Easy": {**quality["ARC-Easy"]}}}, GateConfig())["lines"][3]
    assert "from the tasks' standard errors" in line["detail"]


def test_the_card_carries_the_recipe_and_takes_the_gate(tmp_path):
    recipe = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "num_key_value_layers": 2, "train": {"max_steps": 8}}
    figures = {"step": 8, "heldout_kl_at_start": 0.9, "heldout_kl": 0.3, "heldout_top1_at_start": 0.4,
               "heldout_top1": 0.6}
    (tmp_path / "README.md").write_text(card_text(tiny_config("llama"), recipe, figures))
    card = (tmp_path / "README.md").read_text()
    assert card.startswith("---\n") and "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
    assert "max_steps: 8" in card and "0.9000 before distillation, 0.3000 after" in card and NO_GATE in card
    gate = format_gate(judge(_results(0.9, 0.95), GateConfig()))
    assert write_gate(tmp_path, gate) and write_gate(tmp_path, gate)  # a second evaluation replaces the first
    card = (tmp_path / "README.md").read_text()
    assert card.count("Quality gate for `distilled`: PASS") == 1 and NO_GATE not in card
    assert not write_gate(tmp_path / "elsewhere", gate)  # no card of ours: left alone
