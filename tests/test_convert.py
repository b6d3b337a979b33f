"""Base -> SwiftKV conversion: the paper's initialisation, the checkpoint round trip, the CLI and
its errors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import swiftkv.modeling  # noqa: F401  (registers the SwiftKV Auto classes)
from swiftkv.cli import main as cli
from swiftkv.convert import convert_model
from tests.tiny import save_tiny_base

FAMILIES = ["llama", "mistral", "qwen2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_initialisation_follows_the_paper(family, tmp_path):
    base = save_tiny_base(tmp_path, family, num_hidden_layers=6)
    swift = convert_model(base, num_key_value_layers=2, key_value_group_size=2)
    b, s = base.state_dict(), swift.state_dict()
    torch.testing.assert_close(s["model.norm_swiftkv.weight"], b["model.layers.2.input_layernorm.weight"])
    kinds = ("weight", "bias") if family == "qwen2" else ("weight",)
    for j in range(2, 6):
        for kind in kinds:
            torch.testing.assert_close(s[f"model.layers.{j}.self_attn.q_proj_swiftkv.{kind}"],
                                       b[f"model.layers.{j}.self_attn.q_proj.{kind}"])
    for leader in (2, 4):
        for proj in ("k_proj", "v_proj"):
            for kind in kinds:
                mean = (b[f"model.layers.{leader}.self_attn.{proj}.{kind}"]
                        + b[f"model.layers.{leader + 1}.self_attn.{proj}.{kind}"]) / 2
                torch.testing.assert_close(s[f"model.layers.{leader}.self_attn.{proj}_swiftkv.{kind}"], mean)
    assert "model.layers.3.self_attn.k_proj_swiftkv.weight" not in s
    ids = torch.randint(3, 200, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(swift.swiftkv(False)(ids).logits, base(ids).logits, rtol=0, atol=1e-6)


def test_checkpoint_round_trip_through_the_cli(tmp_path):
    base = save_tiny_base(tmp_path / "base", "qwen2", num_hidden_layers=4)
    out = tmp_path / "swift"
    assert cli(["convert", str(tmp_path / "base"), str(out), "--cutoff", "0.5", "--key-value-group-size", "2"]) == 0
    config = AutoConfig.from_pretrained(out)
    assert (config.model_type, config.architectures) == ("qwen2_swiftkv", ["Qwen2SwiftKVForCausalLM"])
    assert (config.swiftkv, config.num_key_value_layers, config.key_value_group_size) == (True, 2, 2)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    expected = convert_model(base, 2, 2).state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert "assistant" in tokenizer.apply_chat_template([{"role": "user", "content": "w1"}],
                                                       add_generation_prompt=True, tokenize=False)
    # Saving the loaded model again gives the same checkpoint (the published layout both ways).
    loaded.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    ids = torch.randint(3, 200, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, loaded(ids).logits, rtol=0, atol=0)


def test_cli_errors_name_the_problem(tmp_path, capsys):
    save_tiny_base(tmp_path / "base", "llama", num_hidden_layers=4)
    base = str(tmp_path / "base")
    cases = [
        ([str(tmp_path / "missing"), str(tmp_path / "o1")], "does not exist"),
        ([str(tmp_path), str(tmp_path / "o2")], "has no config.json"),
        ([base, str(tmp_path / "o3"), "--num-key-value-layers", "4"], "num_key_value_layers=4 is out of range"),
        ([base, str(tmp_path / "o4"), "--num-key-value-layers", "1", "--key-value-group-size", "2"],
         "key_value_group_size=2 must be >= 1 and divide the 3 layers"),
        ([base, str(tmp_path / "o5"), "--cutoff", "1.5"], "--cutoff must be a fraction"),
        ([base, base], "exists and is not empty"),
    ]
    for args, message in cases:
        assert cli(["convert", *args]) == 2
        assert message in capsys.readouterr().err
    # a failed conversion leaves no output folder behind
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6))


def test_unsupported_family_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(ValueError, match="model family 'gpt2' is not supported; SwiftKV supports: llama, mistral"):
        convert_model(gpt2)
    swift = convert_model(save_tiny_base(tmp_path, "llama"))
    with pytest.raises(ValueError, match="already a SwiftKV model"):
        convert_model(swift)


def test_a_sharded_base_is_converted_shard_by_shard_without_loading_the_model(tmp_path, monkeypatch):
    """The base's shards are copied as they are and the SwiftKV tensors written as one more shard;
    the model is never loaded (a 70B base would need 140 GB of memory)."""
    import swiftkv.convert
    from swiftkv.convert import convert_checkpoint

    base = save_tiny_base(tmp_path / "single", "qwen2", num_hidden_layers=6)
    base.save_pretrained(tmp_path / "base", max_shard_size="200KB")
    for f in (tmp_path / "single").iterdir():  # the tokenizer and chat template
        if not (tmp_path / "base" / f.name).exists() and f.suffix != ".safetensors":
            (tmp_path / "base" / f.name).write_bytes(f.read_bytes())
    shards = sorted((tmp_path / "base").glob("model-*.safetensors"))
    assert len(shards) > 2

    def no_load(*args, **kwargs):
        raise AssertionError("the base model was loaded whole")

    monkeypatch.setattr(swiftkv.convert, "load_base_model", no_load)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_load)
    out = convert_checkpoint(str(tmp_path / "base"), tmp_path / "swift", num_key_value_layers=2, key_value_group_size=2)
    monkeypatch.undo()
    for shard in shards:  # copied byte for byte
        assert (out / shard.name).read_bytes() == shard.read_bytes()
    assert (out / "model-swiftkv.safetensors").is_file() and "chat_template" in "".join(p.name for p in out.iterdir())
    loaded = AutoModelForCausalLM.from_pretrained(out)
    expected = convert_model(base, 2, 2).state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    assert all(torch.equal(t, expected[n]) for n, t in loaded.state_dict().items())
