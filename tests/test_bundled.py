"""The bundled real model (SmolLM2-135M-Instruct from a GGUF) and chat data."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from swiftkv.bundled import (
    bundled_chat_data,
    copy_bundled_tokenizer,
    ensure_bundled_model,
    load_gguf_model,
)
from swiftkv.cli import main

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def bundled_dir():
    return ensure_bundled_model()


@pytest.fixture(scope="module")
def model_and_tokenizer(bundled_dir):
    return AutoModelForCausalLM.from_pretrained(bundled_dir), AutoTokenizer.from_pretrained(bundled_dir)


def _chat_inputs(tokenizer):
    return tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


def test_folder_is_a_plain_float32_llama(bundled_dir, model_and_tokenizer):
    config = json.loads((bundled_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    model, tokenizer = model_and_tokenizer
    assert model.dtype == torch.float32
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is" in prompt
    assert tokenizer.eos_token == "<|im_end|>"


def test_logits_equal_the_gguf_model(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    inputs = _chat_inputs(tokenizer)
    with torch.no_grad():
        ours = model(**inputs).logits
        reference = load_gguf_model()(**inputs).logits
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)


def test_greedy_chat_answer(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    inputs = _chat_inputs(tokenizer)
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_second_call_reuses_the_folder(bundled_dir):
    before = (bundled_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_bundled_model(bundled_dir) == bundled_dir
    assert (bundled_dir / "model.safetensors").stat().st_mtime_ns == before


def test_refuses_a_folder_that_is_not_a_model(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="holds no converted model"):
        ensure_bundled_model(tmp_path)
    assert main(["bundle", str(tmp_path)]) == 2
    assert "holds no converted model" in capsys.readouterr().err


def test_cli_prints_the_folder(bundled_dir, capsys):
    assert main(["bundle", str(bundled_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(bundled_dir)


def test_copy_tokenizer(tmp_path, model_and_tokenizer):
    copy_bundled_tokenizer(tmp_path)
    copied = AutoTokenizer.from_pretrained(tmp_path)
    _, tokenizer = model_and_tokenizer
    assert copied.get_vocab() == tokenizer.get_vocab()
    assert copied.apply_chat_template(QUESTION, tokenize=False) == tokenizer.apply_chat_template(
        QUESTION, tokenize=False
    )
    assert not list(tmp_path.glob("*.safetensors"))


def test_chat_data_alternates_user_assistant():
    data = bundled_chat_data()
    assert len(data) > 3000
    for conversation in data:
        roles = [m["role"] for m in conversation]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        assert all(m["content"] and m["content"] == m["content"].strip() for m in conversation)
    package_dir = importlib.util.find_spec("chitchat_dataset").submodule_search_locations[0]
    raw = json.loads(Path(package_dir, "dataset.json").read_text())
    first_turn = next(iter(raw.values()))["messages"][0]
    assert data[0][0]["content"] == "\n".join(u["text"] for u in first_turn)
    assert len(bundled_chat_data(limit=5)) == 5
