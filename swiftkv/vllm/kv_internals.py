"""Every use of vLLM internals below its public model API, kept in one place.

SwiftKV needs three things vLLM 0.32 offers only internally:
- writing K/V into a layer's paged cache from outside that layer's ``Attention.forward``
  (the KV of layers ``>= c`` is computed once from the cutoff state, for every token);
- reading which rows of the batch need logits, which the model runner hands the KV-sharing
  layers when ``cache_config.kv_sharing_fast_prefill`` is on;
- switching that flag on for our architectures alone (``MODELS_CONFIG_MAP``).
When a vLLM upgrade moves any of these, this module is the one to change.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import unified_kv_cache_update
from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig
from vllm.utils.torch_utils import _encode_layer_name
from vllm.v1.attention.backends.utils import KVSharingFastPrefillMetadata


def write_kv_cache(attn: Attention, key: torch.Tensor, value: torch.Tensor) -> None:
    """Store ``key``/``value`` (``[tokens, kv_heads * head_dim]``, every scheduled token) in the paged
    KV cache of ``attn``, exactly as its own forward would (same slots, same FP8 scaling)."""
    key = key.view(-1, attn.num_kv_heads, attn.head_size)
    value = value.view(-1, attn.num_kv_heads, attn.head_size_v)
    if attn.use_direct_call:
        unified_kv_cache_update(key, value, attn.layer_name)
    else:  # the opaque custom op, as Attention.forward calls it on CPU and CUDA
        torch.ops.vllm.unified_kv_cache_update(key, value, _encode_layer_name(attn.layer_name))


def logits_rows(kv_sharing_layer: Attention) -> tuple[torch.Tensor, int] | None:
    """The batch rows whose logits the runner will read, when fast prefill is armed for this step.

    Returns ``(indices_padded, num_indices)``: ``indices_padded`` may be longer than
    ``num_indices`` (CUDA-graph padding repeats the last row); the KV-sharing layers were given
    attention metadata for exactly these rows. ``None`` (profiling and warm-up runs, flag off)
    means every row must go through the later layers.
    """
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return None
    metadata = attn_metadata.get(kv_sharing_layer.layer_name)
    if not isinstance(metadata, KVSharingFastPrefillMetadata) or metadata.logits_indices_padded is None:
        return None
    return metadata.logits_indices_padded, metadata.num_logits_indices


def register_config_hook(architecture: str, hook: type[VerifyAndUpdateConfig]) -> None:
    """Run ``hook.verify_and_update_config(vllm_config)`` for ``architecture`` before the engine
    is built (vLLM calls it before the model runner reads the cache config)."""
    MODELS_CONFIG_MAP[architecture] = hook


def compile_unit(tag: str) -> AbstractContextManager[None]:
    """Give the ``support_torch_compile`` modules built inside their own compilation cache and
    graphs (two compiled units per model, as Gemma3n's YOCO split does)."""
    from vllm.compilation.backends import set_model_tag  # imported late, as vLLM's own models do

    return set_model_tag(tag)
