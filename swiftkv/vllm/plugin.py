"""The ``vllm.general_plugins`` entry point (``swiftkv = "swiftkv.vllm.plugin:register"``).

vLLM calls ``register()`` in every process it starts (driver, engine core, workers), so the
SwiftKV architectures exist wherever a checkpoint is resolved or built (the config classes are
registered with transformers by importing ``swiftkv``, which loading this entry point does).
"""

from __future__ import annotations


def register() -> None:
    """Register the SwiftKV architectures with vLLM."""
    from vllm import ModelRegistry

    from swiftkv.vllm.engine_config import (
        ARCHITECTURES,
        LATENT_ATTENTION_ARCHITECTURES,
        MODEL_MODULES,
        SwiftKVEngineConfig,
    )
    from swiftkv.vllm.kv_internals import refuse_prompt_logprobs, register_config_hook, register_mla_model_type

    for architecture, model_type in ARCHITECTURES.items():
        # Lazy "module:class" form: the model module (and CUDA) is imported only when built.
        ModelRegistry.register_model(architecture, f"{MODEL_MODULES[architecture]}:{architecture}")
        register_config_hook(architecture, SwiftKVEngineConfig)
        if architecture in LATENT_ATTENTION_ARCHITECTURES:
            register_mla_model_type(model_type)  # vLLM decides latent attention by model_type
    refuse_prompt_logprobs(frozenset(ARCHITECTURES))
