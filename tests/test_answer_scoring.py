"""Teacher-forced answer scores (swiftkv/evaluation/answer_scoring.py): ``exact`` is greedy
generation's exact match, ``logprob`` the answer's log-probability under the full forward, for the
student (with prefill skipping when it generates) and for its base; at c = L - 1 the two are one."""

from __future__ import annotations

import pytest
import torch

from swiftkv.convert import convert_model
from swiftkv.evaluation.answer_scoring import score_answer, summarise
from tests.tiny import save_tiny_base, tiny_swiftkv_model


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_exact_is_greedy_generation_and_logprob_the_full_forward(family):
    model = tiny_swiftkv_model(family, num_hidden_layers=4, num_key_value_layers=2)
    prompt = torch.randint(3, 200, (1, 30), generator=torch.Generator().manual_seed(0))
    for student in (True, False):
        model.swiftkv(student)
        with torch.no_grad():
            greedy = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                    do_sample=False)[0, 30:].tolist()
        scores = score_answer(model, prompt[0].tolist(), greedy)
        assert scores["model" if student else "base"].exact
        wrong = greedy[:-1] + [(greedy[-1] + 1) % 200]
        assert not score_answer(model, prompt[0].tolist(), wrong)["model" if student else "base"].exact
        model.swiftkv(student)
        with torch.no_grad():
            logits = model(torch.tensor([prompt[0].tolist() + greedy]), use_cache=False).logits[0, 29:-1]
        want = torch.log_softmax(logits, -1)[torch.arange(4), torch.tensor(greedy)].sum()
        got = scores["model" if student else "base"].logprob
        assert got == pytest.approx(float(want), abs=1e-4)
    score_answer(model.swiftkv(False), prompt[0].tolist(), greedy)
    assert model.config.swiftkv  # the scorer leaves a SwiftKV model as the student


def test_at_the_last_layer_the_student_scores_as_its_base(tmp_path):
    base = save_tiny_base(tmp_path, "llama", num_hidden_layers=4)
    model = convert_model(base, num_key_value_layers=3)
    samples = [score_answer(model, list(range(5 + i, 40 + i)), [7, 8, 9]) for i in range(3)]
    cell = summarise(samples)
    assert cell["n"] == 3 and cell["delta"] == pytest.approx(0, abs=1e-4)
    assert cell["exact"] == cell["base_exact"] and cell["logprob"] == pytest.approx(cell["base_logprob"], abs=1e-4)
    plain = score_answer(base, list(range(5, 40)), [7, 8, 9])  # a checkpoint that is not SwiftKV is its own base
    assert plain["model"] == plain["base"] and plain["model"].logprob == pytest.approx(samples[0]["base"].logprob,
                                                                                        abs=1e-4)
