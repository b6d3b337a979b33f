"""Tiny random SwiftKV models for tests: small enough for 2 CPU cores, random SwiftKV weights so
that a wrong wiring changes the outputs (the converted init would make some bugs invisible)."""

from __future__ import annotations

import dataclasses

import torch

from swiftkv.config import SwiftKVFields
from swiftkv.modeling import FAMILIES

SWIFTKV_FIELDS = tuple(field.name for field in dataclasses.fields(SwiftKVFields))
"""The config keys SwiftKV adds, which a base model's config does not have."""

# The bundled SmolLM2 tokenizer's vocabulary, so tiny checkpoints can reuse a real tokenizer.
TINY_VOCAB = 49152

FAMILY_OVERRIDES = {
    "llama": {},
    # A window shorter than the test prompts, so the sliding-window masks are exercised.
    "mistral": {"sliding_window": 24},
    "qwen2": {},  # q/k/v biases come with the family
    # Per-head q/k norms come with the family; a head_dim that is not hidden / heads, as in Qwen3-8B's attention.
    "qwen3": {"head_dim": 32},
    # Latent attention (no query LoRA, as in DeepSeek-V2-Lite; tests set q_lora_rank for the other form)
    # and a mixture of experts after one dense layer; every head its own KV head, as in the real models.
    "deepseek_v2": {
        "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 32,
    },
}
# Named variants of a family (``family-variant``): DeepSeek-V2 with a query LoRA rank (q_a/q_b), as in DeepSeek-V2.
VARIANT_OVERRIDES = {"q_lora": {"q_lora_rank": 24}}


def split_family(name: str) -> tuple[str, dict]:
    """``"deepseek_v2-q_lora"`` -> ``("deepseek_v2", {"q_lora_rank": 24})``; a plain family name has no overrides."""
    family, _, variant = name.partition("-")
    return family, dict(VARIANT_OVERRIDES[variant]) if variant else {}


def tiny_config(
    family: str,
    num_hidden_layers: int = 4,
    num_key_value_layers: int = 2,
    key_value_group_size: int = 1,
    swiftkv: bool = True,
    **overrides,
):
    family, variant = split_family(family)
    config_cls, _ = FAMILIES[family]
    fields = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    fields.update(FAMILY_OVERRIDES[family])
    fields.update(variant)
    fields.update(overrides)
    return config_cls(
        num_hidden_layers=num_hidden_layers,
        num_key_value_layers=num_key_value_layers,
        key_value_group_size=key_value_group_size,
        swiftkv=swiftkv,
        **fields,
    )


def randomize_swiftkv_weights(model, seed: int = 1) -> None:
    """Give every SwiftKV weight values unlike the base weights (and ``norm_swiftkv`` not all ones)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.swiftkv_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            value = 1.0 + 0.2 * noise if name.endswith("norm_swiftkv.weight") else 0.08 * noise
            param.copy_(value.to(param.dtype))


def tiny_swiftkv_model(family: str = "llama", seed: int = 0, **config_kwargs):
    """A float32 SwiftKV model in eval mode, student on, with random base and SwiftKV weights."""
    torch.manual_seed(seed)
    _, model_cls = FAMILIES[split_family(family)[0]]
    model = model_cls(tiny_config(family, **config_kwargs)).eval()
    randomize_swiftkv_weights(model, seed + 1)
    return model


def tiny_tokenizer():
    """A word-level tokenizer with a ChatML template, built offline (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
    words += [f"w{i}" for i in range(200)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    return tokenizer


def save_tiny_base(
    path,
    family: str = "llama",
    num_hidden_layers: int = 4,
    seed: int = 0,
    bundled_tokenizer: bool = False,
    **config_overrides,
):
    """A tiny random *base* (non-SwiftKV) checkpoint with a tokenizer, as a user's base model folder:
    the offline word-level one, or the bundled SmolLM2 tokenizer (real chat template, 49152 ids)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from swiftkv.bundled import copy_bundled_tokenizer

    config = tiny_config(family, num_hidden_layers=num_hidden_layers, **config_overrides)
    fields = {k: v for k, v in config.to_dict().items()
              if k not in ("model_type", "architectures", "transformers_version", *SWIFTKV_FIELDS)}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(split_family(family)[0], **fields))
    with torch.no_grad():  # norms away from their all-ones init, so that a norm read from the wrong place shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn(param.shape))
    model.save_pretrained(path)
    if bundled_tokenizer:
        copy_bundled_tokenizer(path)
    else:
        tiny_tokenizer().save_pretrained(path)
    return model.eval()
