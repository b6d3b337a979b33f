"""The quality frontier's pieces: the drop-layers baseline's model and budget, and the table and
plot made from an evaluation's results."""

from __future__ import annotations

import json
import math

import torch

from benchmarks import frontier_table
from benchmarks.drop_layers import healed_layers, shortened
from benchmarks.quality_frontier import TOKEN_SHIFT, format_frontier, frontier_rows, plot_frontier
from benchmarks.train_below_cutoff import KVMatch, below_cutoff_parameters
from swiftkv.analysis.flops import swiftkv_param_count
from swiftkv.convert import convert_model
from tests.test_quality_gate import _cell
from tests.tiny import save_tiny_base


def test_the_shortened_model_is_the_bases_first_layers(tmp_path):
    base = save_tiny_base(tmp_path, "llama", num_hidden_layers=6)
    short = shortened(base, 4)
    assert short.config.num_hidden_layers == 4 and base.config.num_hidden_layers == 6
    ids = torch.randint(3, 200, (1, 12))
    with torch.no_grad():
        hidden = base.model(ids, output_hidden_states=True).hidden_states[4]  # the state leaving layer 3
        want = base.lm_head(base.model.norm(hidden))
        torch.testing.assert_close(short(ids).logits, want)
    short.model.layers[0].mlp.up_proj.weight.data.add_(1.0)  # its own weights: the base is untouched
    assert not torch.equal(short.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.weight)
    heal = healed_layers(base, 3)
    per_layer = sum(p.numel() for p in base.model.layers[0].parameters())
    assert heal * per_layer >= swiftkv_param_count(base.config, 3, 1)[0] > (heal - 1) * per_layer


def test_the_kv_match_is_zero_where_the_student_computes_the_teachers_kv(tmp_path):
    # At the cutoff layer itself the copy start's SwiftKV K/V are the teacher's (same input, norm and
    # projections): no error there; a later layer's come from an earlier state and differ.
    base = save_tiny_base(tmp_path, "llama", num_hidden_layers=6).eval()
    student = convert_model(save_tiny_base(tmp_path / "again", "llama", num_hidden_layers=6), 3, 1).eval()
    ids = torch.randint(3, 200, (1, 12))
    at_cutoff, later = KVMatch(base, student, [3]), KVMatch(base, student, [5])
    with torch.no_grad():
        base(ids)
        student(ids)
    assert float(at_cutoff()) < 1e-10 < 1e-3 < float(later())


def test_below_the_cutoff_trains_the_named_projections_with_their_biases(tmp_path):
    student = convert_model(save_tiny_base(tmp_path, "qwen2", num_hidden_layers=6), 3, 1)
    attention = student.model.layers[1].self_attn
    qkv = below_cutoff_parameters(student, [1], ("q", "k", "v"))
    want = [p for m in (attention.q_proj, attention.k_proj, attention.v_proj) for p in (m.weight, m.bias)]
    assert all(a is b for a, b in zip(qkv, want, strict=True))  # Qwen2's q/k/v carry biases
    with_o = below_cutoff_parameters(student, [0, 2], ("q", "k", "v", "o"))
    assert len(with_o) == 2 * 7 and any(p is student.model.layers[2].self_attn.o_proj.weight for p in with_o)


def _rows(c: int = 15, base_sciq: float = 0.8, shift: dict | None = None) -> list[dict]:
    """A frontier run's rows at cutoff ``c`` (of 30 layers): the base, SwiftKV (with the token
    ``shift`` when given), its copy start and the drop-layers baseline, as ``frontier_rows`` makes
    them from an evaluation's results."""

    def needle(exact):
        return {"cells": [_cell(512, exact, 1.0), _cell(2048, exact / 2, 1.0)]}

    def recall(exact):
        return {"recall": {"gaps": [0], "cells": [{"gap": 0, **_cell(0, exact, 1.0)}]}}

    def alone(probed):  # a plain checkpoint is its own probe's base: answer log-prob -3 on both sides
        return [{**c, "base_exact": c["exact"], "logprob": -3.0, "base_logprob": -3.0, "delta": 0.0}
                for c in probed]

    # The base is not probed itself: the SwiftKV model's probe scored it on the same prompts.
    results = {
        "long_context": {f"swiftkv-c{c}": needle(0.4), f"drop-c{c}": {"cells": alone(needle(0.8)["cells"])}},
        "multi_turn": {f"swiftkv-c{c}": recall(0.5), f"drop-c{c}": {"recall": {
            "gaps": [0], "cells": alone(recall(0.5)["recall"]["cells"])}}},
        "quality": {"SciQ": {m: {"score": s, "stderr": 0.02, "n": 500} for m, s in (
            ("base", base_sciq), (f"swiftkv-c{c}", 0.75), (f"rewired-c{c}", 0.6), (f"drop-c{c}", 0.5))}},
    }
    saved = (30 - c) / 30
    facts = {"base": {"method": "base", "cutoff": None, "prefill_saving": 0.0},
             f"swiftkv-c{c}": {"method": "swiftkv", "cutoff": c, "prefill_saving": saved, "k_r2_least_squares": 0.79,
                               "v_r2_least_squares": 0.74,
                               **({"method": TOKEN_SHIFT, "token_shift": shift} if shift else {})},
             f"rewired-c{c}": {"method": "rewired", "cutoff": c, "prefill_saving": saved},
             f"drop-c{c}": {"method": "drop layers", "cutoff": c, "prefill_saving": saved}}
    return frontier_rows(results, facts)


def test_the_table_and_plot_cover_every_model():
    rows = _rows()
    assert [r["model"] for r in rows] == ["base", "swiftkv-c15", "rewired-c15", "drop-c15"]
    assert rows[1]["retrieval"]["2048"]["exact"] == 0.2 and rows[3]["tasks"]["SciQ"]["score"] == 0.5
    assert rows[0]["retrieval"]["2048"]["exact"] == 1.0 and rows[0]["recall"]["exact"] == 1.0
    # The gate: 40% / 20% of the base's retrieval and half its recall fail; SciQ recovered three quarters of its loss.
    gate = rows[1]["gate"]
    assert gate["verdict"] == "FAIL" and [x["verdict"] for x in gate["lines"]] == ["FAIL", "FAIL", "FAIL", "PASS"]
    assert "gate" not in rows[2] and "gate" not in rows[3]
    table = format_frontier(rows)
    assert ("| swiftkv-c15 | 50% | 0.79 / 0.74 | 40% (-0.5) | 20% (-0.5) | 50% (-0.5) | 75.0 ± 2.0 | "
            "**FAIL** (0.75 (95% CI") in table
    assert "| base | 0% | - | 100% (+0.0) | 100% (+0.0) | 100% (+0.0) | 80.0 ± 2.0 | - |" in table
    assert "n = 20 per length" in table and "n = 500 each" in table
    # The drop-layers baseline against the base's answers on the same prompts: -3 - (-0.5).
    assert "| drop-c15 | 50% | - | 80% (-2.5) | 40% (-2.5) | 50% (-2.5) | 50.0 ± 2.0 | - |" in table
    assert math.isnan(rows[3]["retrieval"]["512"]["delta_stderr"]) and rows[3]["recall"]["base_exact"] == 1.0
    assert plot_frontier(rows).startswith(b"\x89PNG")


def _write_run(folder, rows: list[dict]) -> str:
    folder.mkdir()
    (folder / "frontier.json").write_text(json.dumps({"rows": rows}))
    return str(folder)


def test_runs_of_single_cutoffs_make_one_table(tmp_path, capsys):
    runs = [_write_run(tmp_path / "c20", _rows(20)), _write_run(tmp_path / "c15", _rows(15))]
    out = tmp_path / "all"
    assert frontier_table.main(["--set", f"runs={json.dumps(runs)}", "--set", f"out={out}"]) == 0
    rows = json.loads((out / "frontier.json").read_text())["rows"]
    # The base once, then by prefill saved (c = 20 saves 33%, c = 15 50%), each cutoff's rows together.
    assert [r["model"] for r in rows] == ["base", "swiftkv-c20", "rewired-c20", "drop-c20",
                                          "swiftkv-c15", "rewired-c15", "drop-c15"]
    table = (out / "frontier.md").read_text()
    assert table.count("| base |") == 1 and "| swiftkv-c20 | 33% |" in table and "| drop-c15 | 50% |" in table
    assert (out / "frontier.png").read_bytes().startswith(b"\x89PNG")
    # Another base (or other documents) would put the rows on different scales: refused, naming the run.
    other = _write_run(tmp_path / "other", _rows(18, base_sciq=0.7))
    assert frontier_table.main(["--set", f"runs={json.dumps([runs[0], other])}", "--set", f"out={out}"]) == 2
    assert f"{other}: its base scored otherwise" in capsys.readouterr().err
    # Fewer documents per task in one run: refused too.
    smaller = _rows(23)
    for row in smaller:
        row["tasks"]["SciQ"]["n"] = 100
    small = _write_run(tmp_path / "small", smaller)
    assert frontier_table.main(["--set", f"runs={json.dumps([runs[0], small])}", "--set", f"out={out}"]) == 2
    assert f"{small}: measured on other sizes" in capsys.readouterr().err
    assert frontier_table.main(["--set", f"runs={json.dumps([str(tmp_path / 'none')])}"]) == 2
    assert "none/frontier.json: no frontier here" in capsys.readouterr().err


def test_a_token_shift_run_is_its_own_row_beside_the_plain_one(tmp_path):
    plain = _write_run(tmp_path / "c15", _rows(15))
    shifted = _write_run(tmp_path / "c15-shift", _rows(15, shift={"layers": [17, 18], "tokens": 2}))
    out = tmp_path / "all"
    assert frontier_table.main(["--set", f"runs={json.dumps([plain, shifted])}", "--set", f"out={out}"]) == 0
    rows = json.loads((out / "frontier.json").read_text())["rows"]
    assert [(r["model"], r["method"]) for r in rows if r["model"] == "swiftkv-c15"] == [
        ("swiftkv-c15", "swiftkv"), ("swiftkv-c15", TOKEN_SHIFT)]
    table = (out / "frontier.md").read_text()
    assert "| swiftkv-c15 | 50% |" in table
    assert "| swiftkv-c15 + token shift (layers 17, 18, 2 before) | 50% | 0.79 / 0.74 | 40% (-0.5) |" in table
    assert table.count("**FAIL**") == 2  # each SwiftKV row judged by the gate
