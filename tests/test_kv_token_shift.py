"""The token-shift diagnosis (benchmarks/kv_token_shift.py): its features, its fits and its K/V put in
place of the student's, checked where the answer is known: on the copy start the cutoff layer's
teacher K/V are exactly linear in the SwiftKV input, so that fit must be exact and, put in place of
the student's own (also exact), must leave the student's scores as they are."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.kv_token_shift import KVTokenShiftConfig, fit_shifted_kv, run, shifted_replacement, token_features
from benchmarks.retrieval_layers import score_prompt
from swiftkv.convert import convert_checkpoint, convert_model
from tests.tiny import save_tiny_base


def test_token_features_hold_each_token_and_the_ones_before_it():
    x = torch.arange(8.0).view(4, 2)
    assert token_features(x, 2).tolist() == [[0, 1, 0, 0, 1], [2, 3, 0, 1, 1], [4, 5, 2, 3, 1], [6, 7, 4, 5, 1]]
    assert token_features(x[:1], 3).tolist() == [[0, 1, 0, 0, 0, 0, 1]]


def test_the_fit_of_the_cutoff_layer_is_exact_and_replaces_the_student_s_kv_unchanged(tmp_path):
    model = convert_model(save_tiny_base(tmp_path, "llama", num_hidden_layers=4), num_key_value_layers=2)
    rng = random.Random(0)
    rows = [[rng.randrange(5, 1000) for _ in range(48)] for _ in range(8)]
    weights, r2 = fit_shifted_kv(model, {"fit": rows[:6], "heldout": rows[6:]}, [1, 2], ridge=1e-9)
    assert set(r2) == {1, 2} and set(r2[1]) == {"k2", "v2", "k3", "v3"}
    assert min(r2[n][f"{kind}2"] for n in (1, 2) for kind in "kv") > 0.999  # layer c: linear in its own token
    assert r2[1]["k3"] < 0.999  # layer 3's keys are not (its input went through layer 2)
    model.swiftkv(True)
    prompt, answer = [rng.randrange(5, 1000) for _ in range(40)], [7, 8]
    fitted = shifted_replacement(weights, 1)
    scores = score_prompt(model, prompt, answer, {"student": [], "fit": [2], "fit of layer 3": [3]},
                          {"fit": fitted, "fit of layer 3": fitted})
    assert scores["fit"][0] == pytest.approx(scores["student"][0], abs=1e-3)
    # The replacement does take effect: layer 3's fit is not its copy-start K/V, and the score moves.
    assert abs(scores["fit of layer 3"][0] - scores["student"][0]) > 1e-4
    assert abs(scores["student"][0] - scores["base"][0]) > 1e-3  # layer 3's SwiftKV K/V differ from its own


def test_fits_scored_on_their_own_text_are_refused_before_any_model_loads():
    with pytest.raises(ValueError, match="must be scored on other text"):
        run(KVTokenShiftConfig(model="no/such/folder", fit_filler="essays", filler="essays"))


def test_the_job_end_to_end_on_a_tiny_checkpoint(tmp_path):
    """The whole job on the real fillers and chat template: its tables, and a layer it cannot
    replace refused by name."""
    save_tiny_base(tmp_path / "base", "llama", num_hidden_layers=4, bundled_tokenizer=True)
    model = str(convert_checkpoint(str(tmp_path / "base"), tmp_path / "swiftkv", num_key_value_layers=2))
    small = {"model": model, "shifts": [1, 2], "fit_rows": 3, "heldout_rows": 1, "row_tokens": 160,
             "lengths": [160], "depths": [0.5], "samples": 2, "out": str(tmp_path / "out")}
    with pytest.raises(ValueError, match=r"layers \[1\]: each must be a SwiftKV layer .* \(2 to 3\)"):
        run(KVTokenShiftConfig(**small, layers=[1]))
    result = run(KVTokenShiftConfig(**small))
    assert result["heldout_r2"]["1"]["k2"] > 0.999  # layer c's K: linear in the token's own state
    assert set(result["retrieval"]) == {"base", "student", "1 token(s), layers 2-3", "1 token(s), layer 3",
                                        "2 token(s), layers 2-3", "2 token(s), layer 3"}
    assert result["retrieval"]["student"][160]["n"] == 2
    table = (tmp_path / "out" / "kv_token_shift.md").read_text()
    assert "| 3 | " in table and "| 2 token(s), layers 2-3 | " in table
