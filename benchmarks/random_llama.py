"""The larger random Llama that the benchmarks run beside the bundled SmolLM2: 16 layers, hidden
1024, GQA with 16 query / 4 KV heads (about 0.25B parameters), the bundled tokenizer's 49,152-token
vocabulary and 16K positions. Speed does not depend on the weights, so random ones (seed 0) do."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

NAME = "random-llama"
CONFIG = dict(
    vocab_size=49152, hidden_size=1024, intermediate_size=3584, num_hidden_layers=16,
    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=16384,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)


def random_llama(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """The random Llama in ``dtype``, eval mode, always the same weights."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).to(dtype).eval()
