"""The main job as a user runs it (``python -m ray_jobs.main --set quick=true``): every step on the
bundled real model, a local Ray, real vLLM engines and a real ``swiftkv serve`` asked through the
``openai`` client; every figure of ``report.json`` present and sane, nothing left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ray_jobs.main import MainConfig, main
from tests.serve_cluster import CACHE, engine_processes

MODELS = ("base", "rewired", "distilled")


@pytest.mark.timeout(1800)  # 7-12 minutes on two cores; the suite's default is 900 s
def test_quick_main_job_runs_every_step_and_reports_sane_figures(tmp_path):
    out = tmp_path / "main"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "VLLM_CACHE_ROOT": str(CACHE / "vllm")}
    # Its own process group, so that a run past the deadline is stopped with everything it started.
    proc = subprocess.Popen([sys.executable, "-m", "ray_jobs.main", "--set", "quick=true", "--set", f"out={out}"],
                            env=env, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=1500)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    assert proc.returncode == 0, output[-6000:]
    check_quick_report(out)
    assert not engine_processes()


def check_quick_report(out: Path) -> None:
    """Every figure of a quick run's ``report.json`` present and sane, and the report's plots written."""
    report = json.loads((out / "report.json").read_text())

    # The shipped recipe's cutoff (the deepest that passes the gate here); SimScore's suggestion beside it.
    assert report["quick"] and report["cutoff"]["source"] == "the recipe's num_key_value_layers"
    c = report["cutoff"]["num_key_value_layers"]
    recipe = yaml.safe_load((Path(__file__).resolve().parents[1] / MainConfig().distill).read_text())
    assert c == recipe["num_key_value_layers"] and 0 < report["cutoff"]["simscore_recommended"] < report["num_layers"]
    assert json.loads((out / "rewired/config.json").read_text())["num_key_value_layers"] == c
    d = report["distill"]
    assert d["steps"] == 4 and d["heldout_kl"] < d["heldout_kl_at_start"]  # distillation moved toward the teacher

    for task in ("ARC-Easy", "PIQA"):
        assert set(report["quality"][task]) == set(MODELS)
        for model in MODELS:
            part = report["quality"][task][model]
            assert 0 <= part["score"] <= 1 and part["stderr"] > 0 and part["n"] == 8, (task, model, part)
    # The probes run on the distilled model, its base scored beside it on the same prompts.
    assert set(report["long_context"]) == set(report["multi_turn"]) == {"distilled"}
    cells = report["long_context"]["distilled"]["cells"]
    assert [(x["length"], x["n"]) for x in cells] == [(512, 2), (2048, 2)]
    # The probes measure something: the base finds the needle in 512 tokens and recalls a fact stated
    # just before the question (teacher-forced, float32: deterministic).
    assert cells[0]["base_exact"] == 1.0 and cells[0]["base_logprob"] > cells[0]["logprob"]
    turns = report["multi_turn"]["distilled"]
    assert turns["recall"]["gaps"] == [0, 2] and turns["recall"]["cells"][0]["base_exact"] == 1.0
    assert all(kl > 0 for kl in turns["chitchat"]["kl"]) and len(turns["mtbench"]["kl"]) == 2
    # The gate judged it, line by line, first in the report; the checkpoint's model card has it too.
    gate = report["gate"]
    assert gate["verdict"] in ("PASS", "FAIL") and [x["line"] for x in gate["lines"]] == [
        "retrieval at 512 tokens", "retrieval at 2048 tokens", "recall across turns", "recovered share"]
    card = (Path(report["checkpoint"]) / "README.md").read_text()
    assert f"Quality gate for `distilled`: {gate['verdict']}" in card and "least_squares" in card

    bench = report["prefill_benchmark"]
    (row,) = bench["throughput_tok_s"]
    assert row["cell"] == "512x1" and row[f"swiftkv c={c} / base"] > 1.0  # 12 of the 30 layers skip the prompt
    assert bench["kv_capacity"][f"swiftkv c={c}"]["ratio"] == 1.0

    served = report["serve"]
    assert served["exit_code"] == 0 and served["models"] == ["base", "swiftkv"]
    for name in ("served base", "served swiftkv", "teacher", "student"):
        assert len(report["answers"][name]) == 3 and all(report["answers"][name]), name
    assert set(report["seconds"]) == {"SimScore", "convert", "distil", "answers", "evaluate", "prefill benchmark",
                                      "serve", "report"}

    md = (out / "report.md").read_text()
    assert md.splitlines()[2].startswith("**Quality gate for `distilled`: ")
    assert "| ARC-Easy (0-shot, acc_norm) |" in md and "Needle retrieval" in md
    for plot in ("simscore/simscore.png", "eval/quality.png", "eval/needle.png", "eval/multiturn.png",
                 "bench/throughput_ratio.png"):
        assert f"]({plot})" in md and (out / plot).read_bytes().startswith(b"\x89PNG"), plot


def test_bad_main_job_config_is_one_error_line(capsys):
    assert main(["--set", "cutoff=middle"]) == 2
    assert "cutoff: Input should be 'simscore' or 'recipe'" in capsys.readouterr().err
    # A bad key in a sub-config is refused before any work starts.
    assert main(["--set", 'evaluate_overrides=["needle.depths=[2]"]']) == 2
    assert "depths must lie in [0, 1]" in capsys.readouterr().err
    # A value that is not YAML is named, not a traceback.
    assert main(["--set", "evaluate_overrides=[needle.depths=[2]]"]) == 2
    assert "the value is not valid YAML" in capsys.readouterr().err
