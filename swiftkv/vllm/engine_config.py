"""Checks a SwiftKV checkpoint against the engine settings before anything is built, and turns on
vLLM's prefill early exit (``kv_sharing_fast_prefill``) for checkpoints with ``swiftkv: true``."""

from __future__ import annotations

import logging

import torch
from pydantic import BaseModel, ConfigDict
from vllm.config import VllmConfig
from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.platforms import current_platform

from swiftkv.config import is_latent_attention, layer_types
from swiftkv.modeling import FAMILIES
from swiftkv.vllm.kv_internals import prefer_reference_cpu_mla
from swiftkv.vllm.layout import SwiftKVLayout

logger = logging.getLogger(__name__)

# Architecture -> the model_type its checkpoints carry (the HF classes' names, as in config.json).
ARCHITECTURES = {model_cls.__name__: config_cls.model_type for config_cls, model_cls in FAMILIES.values()}
# The architectures with latent attention (MLA), served by their own vLLM model file; the others by model.py.
LATENT_ATTENTION_ARCHITECTURES = frozenset({"DeepseekV2SwiftKVForCausalLM"})
# Architecture -> the module of its vLLM model class.
MODEL_MODULES = {
    architecture: "swiftkv.vllm.deepseek_v2" if architecture in LATENT_ATTENTION_ARCHITECTURES else "swiftkv.vllm.model"
    for architecture in ARCHITECTURES
}
# Quantisation methods the model's layers take as they are (None: unquantised; fp8: vLLM's online
# FP8 weight quantisation, which works on any linear layer). Checkpoint-quantised formats would
# need their packed tensors mapped onto the SwiftKV projections, which we do not do.
SUPPORTED_QUANTIZATION = (None, "fp8")


class SwiftKVServingOptions(BaseModel):
    """Engine options for SwiftKV checkpoints: ``additional_config={"swiftkv": {...}}`` in Python,
    ``--additional-config '{"swiftkv": {...}}'`` on vLLM's command line."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    prefill_skipping: bool = True
    """Run layers ``>= c`` only on the rows that need logits. Off: every token runs every layer
    (same outputs, base-model prefill cost), which is what prompt logprobs need; with it on,
    vLLM refuses requests that ask for prompt logprobs."""

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig) -> SwiftKVServingOptions:
        extra = vllm_config.additional_config
        return cls.model_validate(extra.get("swiftkv", {}) if isinstance(extra, dict) else {})


def check_serving_config(vllm_config: VllmConfig) -> SwiftKVLayout:
    """Raise ``ValueError`` naming the problem if this engine cannot serve the checkpoint."""
    model_config = vllm_config.model_config
    config = model_config.hf_config
    expected = ARCHITECTURES.get(model_config.architecture)
    if expected != config.model_type:
        raise ValueError(
            f"architecture {model_config.architecture} expects model_type {expected!r}, "
            f"but the checkpoint's config.json says {config.model_type!r}"
        )
    parallel = vllm_config.parallel_config
    layout = SwiftKVLayout.from_config(config, parallel.tensor_parallel_size)
    if model_config.quantization not in SUPPORTED_QUANTIZATION:
        raise ValueError(
            f"quantization={model_config.quantization!r} is not supported by the SwiftKV model "
            f"(supported: unquantised or online 'fp8'); the KV cache can still use kv_cache_dtype='fp8'"
        )
    if is_latent_attention(config) and model_config.dtype == torch.float16:
        # vLLM's DeepSeek-V2 layers rescale the residual stream in float16 (overflow), which the
        # SwiftKV layers after the cutoff do not mirror.
        raise ValueError("DeepSeek-V2 SwiftKV checkpoints are served in bfloat16 or float32, not float16")
    if not config.swiftkv:
        return layout
    if parallel.pipeline_parallel_size > 1:
        raise ValueError(
            f"SwiftKV serving does not support pipeline parallelism "
            f"(pipeline_parallel_size={parallel.pipeline_parallel_size}); use tensor parallelism"
        )
    tp, heads = parallel.tensor_parallel_size, layout.heads
    if heads.total_num_kv_heads % tp or heads.total_num_heads % tp:
        raise ValueError(
            f"SwiftKV with tensor_parallel_size={tp} needs num_attention_heads="
            f"{heads.total_num_heads} and num_key_value_heads={heads.total_num_kv_heads} divisible by it"
        )
    kinds = layer_types(config)
    for leader in layout.leaders:
        group = kinds[leader : leader + layout.group_size]
        if len(set(group)) > 1:
            raise ValueError(
                f"AcrossKV group starting at layer {leader} mixes attention kinds {group}: a group "
                "shares one KV cache, so its layers must all use the same (sliding) window"
            )
    return layout


class SwiftKVEngineConfig(VerifyAndUpdateConfig):
    """vLLM runs this hook for our architectures before the engine is built."""

    @staticmethod
    def verify_and_update_config(vllm_config: VllmConfig) -> None:
        layout = check_serving_config(vllm_config)
        options = SwiftKVServingOptions.from_vllm_config(vllm_config)
        if is_latent_attention(vllm_config.model_config.hf_config) and current_platform.is_cpu():
            prefer_reference_cpu_mla(vllm_config)
            # vLLM 0.32's CPU rotary kernel rotates a 3-D query ([tokens, heads, dim], as its MLA
            # layers pass it) wrongly (seen here: vLLM's own DeepSeek-V2 differed from the HF model
            # by 1e-3 in logprobs); its PyTorch path is right.
            vllm_config.compilation_config.custom_ops.append("-rotary_embedding")
        if not vllm_config.model_config.hf_config.swiftkv:
            logger.info("swiftkv: false in the checkpoint: serving it as the plain base model")
            return
        if not options.prefill_skipping:
            logger.info("SwiftKV prefill skipping is off: every token runs every layer")
            return
        # Layers >= c all read caches written by earlier layers, so vLLM's YOCO early exit hands
        # them attention metadata for the logits rows only: that is SwiftKV's prefill skipping.
        vllm_config.cache_config.kv_sharing_fast_prefill = True
        logger.info(
            "SwiftKV: %d of %d layers run on prompt tokens; KV cache for %d layers (AcrossKV g=%d)",
            layout.num_kv_layers,
            layout.num_layers,
            layout.num_kv_layers + layout.num_groups,
            layout.group_size,
        )
