"""The random Llamas that speed measurements run beside the bundled SmolLM2 (the benchmarks and
the vLLM engine benchmark, ``ray_jobs/bench_vllm.py``). ``random-llama``: 16 layers, hidden 1024,
GQA with 16 query / 4 KV heads (about 0.25B parameters), the bundled tokenizer's 49,152-token
vocabulary and 16K positions, small enough for a CPU. ``random-llama-8b``: the shape of
Llama-3.1-8B (32 layers, hidden 4096, 32 / 8 heads, 128,256-token vocabulary; 8.0B parameters),
for a GPU. Speed does not depend on the weights, so random ones (seed 0) do."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

NAME = "random-llama"
SHAPES = {
    NAME: dict(
        vocab_size=49152, hidden_size=1024, intermediate_size=3584, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=16384,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    "random-llama-8b": dict(  # Llama-3.1-8B's config.json, less its rope scaling (no effect on speed)
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128009,
    ),
}


def random_llama(dtype: torch.dtype = torch.float32, shape: str = NAME,
                 device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """The random Llama of ``shape`` in ``dtype`` on ``device``, eval mode, always the same weights
    on the same device (initialised there, not on the host: the 8B shape is 32 GB in float32)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape]))
    return model.to(dtype).eval()
