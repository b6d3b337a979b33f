"""The retrieval-layers diagnosis (benchmarks/retrieval_layers.py) puts the teacher's own K/V in place of
chosen SwiftKV layers': checked on the copy start, where the cutoff layer's SwiftKV K/V already are its own
and the queries are the teacher's, so replacing every later layer's K/V must give the base's scores."""

from __future__ import annotations

import pytest

from benchmarks.retrieval_layers import replacement_variants, score_prompt
from swiftkv.convert import convert_model
from tests.tiny import save_tiny_base


def test_the_teachers_own_kv_in_every_swiftkv_layer_gives_the_base(tmp_path):
    model = convert_model(save_tiny_base(tmp_path, "llama", num_hidden_layers=4), num_key_value_layers=2)
    variants = replacement_variants(2, 4)
    assert variants == {"student": [], "layer 2": [2], "layer 3": [3], "layers 2..3": [2, 3]}
    scores = score_prompt(model, list(range(5, 60)), [7, 8, 9], variants)
    base = scores["base"][0]
    assert scores["layers 2..3"][0] == pytest.approx(base, abs=1e-4)
    assert scores["layer 2"][0] == pytest.approx(scores["student"][0], abs=1e-4)  # layer c's K/V are its own
    assert abs(scores["student"][0] - base) > 1e-3  # layer 3's SwiftKV K/V are not
    assert scores["layer 3"][0] == pytest.approx(base, abs=1e-4)
    assert model.config.swiftkv  # left as the student
