"""The Hugging Face SwiftKV classes: teacher = base model, prefill skipping = full student forward,
AcrossKV wiring, trainable set, the published checkpoint layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from swiftkv.modeling import LlamaSwiftKVConfig, LlamaSwiftKVForCausalLM
from tests.tiny import SWIFTKV_FIELDS, tiny_config, tiny_swiftkv_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "deepseek_v2", "deepseek_v2-q_lora"]


def padded_batch(lengths: list[int], vocab: int = 1000, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded random prompts of the given lengths (pad id 2)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), 2, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, vocab, (n,), generator=gen)
        mask[row, width - n :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def base_twin(swift):
    """The family's plain model with the SwiftKV model's base weights."""
    fields = {k: v for k, v in swift.config.to_dict().items()
              if k not in ("model_type", "architectures", *SWIFTKV_FIELDS)}
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(swift.config.model_type[: -len("_swiftkv")], **fields))
    missing, unexpected = base.load_state_dict(swift.state_dict(), strict=False)
    assert not missing and unexpected and all("_swiftkv" in k for k in unexpected)
    return base.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_teacher_is_exactly_the_base_model(family):
    swift = tiny_swiftkv_model(family).swiftkv(False)
    base = base_twin(swift)
    batch = padded_batch([40, 29, 7])
    with torch.no_grad():
        torch.testing.assert_close(swift(**batch).logits, base(**batch).logits, rtol=0, atol=1e-6)
        # and the student really differs (random SwiftKV weights)
        swift.swiftkv(True)
        assert not torch.allclose(swift(**batch).logits, base(**batch).logits, atol=1e-3)


def greedy(model, batch, use_cache: bool, max_new_tokens: int = 6):
    return model.generate(
        **batch, max_new_tokens=max_new_tokens, do_sample=False, use_cache=use_cache,
        output_logits=True, return_dict_in_generate=True, pad_token_id=2,
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("group", [1, 2])
def test_prefill_skipping_equals_full_student_forward(family, group):
    model = tiny_swiftkv_model(family, num_hidden_layers=6, num_key_value_layers=2, key_value_group_size=group)
    batch = padded_batch([33, 12, 26])
    with torch.no_grad():
        skipped = greedy(model, batch, use_cache=True)  # prefill skipping + KV cache
        full = greedy(model, batch, use_cache=False)  # every token through every layer, each step
    assert torch.equal(skipped.sequences, full.sequences)
    for a, b in zip(skipped.logits, full.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # The greedy tokens also match a single full forward over the final sequences.
    with torch.no_grad():
        mask = torch.cat([batch["attention_mask"], torch.ones(3, 6, dtype=torch.long)], dim=1)
        logits = model(skipped.sequences, attention_mask=mask, use_cache=False).logits
    width = batch["input_ids"].shape[1]
    torch.testing.assert_close(logits[:, width - 1 : -1], torch.stack(skipped.logits, 1), rtol=1e-4, atol=1e-4)


def rope_positions(model, run) -> list[torch.Tensor]:
    """The position ids the model's rotary embedding saw on each forward call while ``run()`` runs."""
    seen = []
    hook = model.model.rotary_emb.register_forward_hook(
        lambda module, args, kwargs, out: seen.append(kwargs["position_ids"].clone()), with_kwargs=True)
    try:
        run()
    finally:
        hook.remove()
    return seen


def test_generate_gives_left_padded_rows_their_real_positions():
    """``generate`` hands position ids from the attention mask only to a forward that declares them:
    a padded row must see positions 0, 1, ... from its first real token, as in the base model (with
    RoPE scaling that depends on absolute positions, shifted positions change the outputs)."""
    swift = tiny_swiftkv_model("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
                               max_position_embeddings=16)
    base = base_twin(swift.swiftkv(False))
    batch = padded_batch([30, 21])
    with torch.no_grad():
        ours = rope_positions(swift, lambda: greedy(swift, batch, use_cache=True))
        theirs = rope_positions(base, lambda: greedy(base, batch, use_cache=True))
        tokens = [greedy(model, batch, use_cache=True).sequences for model in (swift, base)]
    assert torch.equal(*tokens)
    assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert ours[0][1, 9:].tolist() == list(range(21))  # the padded row starts at 0 after its 9 pads


def test_flex_attention_is_refused_for_prefill_skipping():
    """Skipping keeps the last query row of each mask, which a flex-attention BlockMask does not have."""
    model = tiny_swiftkv_model("llama")
    model.config._attn_implementation = "flex_attention"
    with torch.no_grad(), pytest.raises(ValueError, match="does not support attn_implementation='flex_attention'"):
        greedy(model, padded_batch([9]), use_cache=True)


def test_sampling_with_skipping_matches_full_student():
    model = tiny_swiftkv_model("llama")
    batch = padded_batch([20, 9])
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        with torch.no_grad():
            outs.append(model.generate(**batch, max_new_tokens=8, do_sample=True, top_k=50,
                                       use_cache=use_cache, pad_token_id=2))
    assert torch.equal(*outs)


def test_prompt_tokens_stop_at_the_cutoff():
    """In prefill only one token per sequence enters the layers after the cutoff."""
    model = tiny_swiftkv_model("llama", num_hidden_layers=4, num_key_value_layers=2)
    rows = {}
    for i in (1, 2, 3):
        model.model.layers[i].mlp.register_forward_hook(
            lambda mod, inp, out, i=i: rows.setdefault(i, []).append(inp[0].shape[1]))
    with torch.no_grad():
        model.generate(**padded_batch([30, 30]), max_new_tokens=3, do_sample=False, pad_token_id=2)
    assert rows[1] == [30, 1, 1]  # before the cutoff: the whole prompt, then one token a step
    assert rows[2] == rows[3] == [1, 1, 1]  # after it: only the last prompt token


def test_forward_without_cache_returns_every_position():
    model = tiny_swiftkv_model("llama")
    batch = padded_batch([15])
    with torch.no_grad():
        full = model(**batch, use_cache=False).logits
        cached = model(**batch, use_cache=True).logits  # logits_to_keep=0: no skipping either
    assert full.shape == cached.shape == (1, 15, model.config.vocab_size)
    torch.testing.assert_close(full, cached, rtol=1e-5, atol=1e-5)


def test_across_kv_leaders_only_and_groups_share_the_leader_kv():
    model = tiny_swiftkv_model("llama", num_hidden_layers=8, num_key_value_layers=2, key_value_group_size=3)
    leaders = {2, 5}
    for j in range(2, 8):
        attn = model.model.layers[j].self_attn
        assert hasattr(attn, "q_proj_swiftkv")
        assert hasattr(attn, "k_proj_swiftkv") == (j in leaders) == hasattr(attn, "v_proj_swiftkv")
    for j in range(2):
        assert not hasattr(model.model.layers[j].self_attn, "q_proj_swiftkv")
    seen = {}
    for j in range(2, 8):
        model.model.layers[j].self_attn.register_forward_pre_hook(
            lambda mod, args, kwargs, j=j: seen.__setitem__(j, kwargs["swiftkv_kv"]), with_kwargs=True)
    with torch.no_grad():
        out = model(**padded_batch([12]), use_cache=True)
    for j in range(2, 8):
        leader = 2 if j < 5 else 5
        assert seen[j][0] is seen[leader][0] and seen[j][1] is seen[leader][1]
    cache = out.past_key_values
    # Only layers 0..c-1 and the leaders hold a cache; the other layers of a group keep none.
    filled = [j for j in range(8) if cache.layers[j].keys is not None and cache.layers[j].keys.numel() > 0]
    assert filled == [0, 1, 2, 5]


def test_trainable_set_is_exactly_the_swiftkv_weights():
    model = tiny_swiftkv_model("qwen2", num_hidden_layers=4, num_key_value_layers=2)
    names = {n for n, _ in model.swiftkv_parameters()}
    expected = {"model.norm_swiftkv.weight"}
    for j in (2, 3):
        for proj in ("q", "k", "v"):
            expected |= {f"model.layers.{j}.self_attn.{proj}_proj_swiftkv.{kind}" for kind in ("weight", "bias")}
    assert names == expected


def test_trainable_share_of_llama_3_1_8b_at_half_depth():
    """Counted on the real 8B architecture, built on the meta device (no weights)."""
    config = LlamaSwiftKVConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_key_value_layers=16, swiftkv=True,
    )
    with torch.device("meta"):
        model = LlamaSwiftKVForCausalLM(config)
    trainable = sum(p.numel() for _, p in model.swiftkv_parameters())
    total = sum(p.numel() for p in model.parameters())
    # 16 layers x (4096x4096 + 2 x 4096x1024) + the 4096 norm weights
    assert trainable == 16 * (4096 * 4096 + 2 * 4096 * 1024) + 4096 == 402_657_280
    base_total = total - trainable
    assert base_total == 8_030_261_248  # Llama-3.1-8B
    assert 0.045 < trainable / total < 0.05 < trainable / base_total < 0.051


def write_published_layout(path, c: int = 2, g: int = 1) -> dict[str, torch.Tensor]:
    """A checkpoint written by hand the way the published SwiftKV checkpoints are: the teacher's
    weights for every layer, plus the SwiftKV weights, and the three config fields."""
    source = tiny_swiftkv_model("llama", num_hidden_layers=4, num_key_value_layers=c, key_value_group_size=g)
    config = source.config.to_dict()
    config.update(model_type="llama_swiftkv", architectures=["LlamaSwiftKVForCausalLM"], swiftkv=True,
                  num_key_value_layers=c, key_value_group_size=g)
    config.pop("transformers_version", None)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return state


def test_published_layout_loads_and_runs(tmp_path):
    state = write_published_layout(tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(model).__name__ == "LlamaSwiftKVForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.swiftkv and model.config.num_key_value_layers == 2
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    with torch.no_grad():
        out = model.generate(**padded_batch([10]), max_new_tokens=4, do_sample=False, pad_token_id=2)
    assert out.shape == (1, 14)


def test_checkpoint_of_the_wrong_shape_fails_clearly(tmp_path, caplog):
    state = write_published_layout(tmp_path)
    state["model.layers.3.self_attn.q_proj_swiftkv.weight"] = torch.zeros(8, 8)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "model.layers.3.self_attn.q_proj_swiftkv.weight | MISMATCH" in caplog.text


def test_checkpoint_without_swiftkv_weights_is_refused(tmp_path):
    state = write_published_layout(tmp_path)
    state = {k: v for k, v in state.items() if "_swiftkv" not in k}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="has no SwiftKV weights for 7 tensors.*swiftkv convert"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize(("c", "g", "message"), [
    (0, 1, "num_key_value_layers=0 is out of range"),
    (4, 1, "num_key_value_layers=4 is out of range"),
    (1, 2, "key_value_group_size=2 must be >= 1 and divide the 3 layers"),
])
def test_bad_swiftkv_fields(c, g, message):
    with pytest.raises(ValueError, match=message):
        tiny_config("llama", num_hidden_layers=4, num_key_value_layers=c, key_value_group_size=g)
