"""The ``vllm.general_plugins`` entry point (``swiftkv = "swiftkv.vllm.plugin:register"``).

vLLM calls ``register()`` in every process it starts (driver, engine core, workers), so the
SwiftKV config classes and architectures exist wherever a checkpoint is resolved or built.
"""

from __future__ import annotations


def register() -> None:
    """Register the SwiftKV configs with transformers and the architectures with vLLM."""
    from vllm import ModelRegistry

    import swiftkv.modeling  # noqa: F401  (registers llama/mistral/qwen2_swiftkv with AutoConfig)
    from swiftkv.vllm.engine_config import ARCHITECTURES, SwiftKVEngineConfig
    from swiftkv.vllm.kv_internals import refuse_prompt_logprobs, register_config_hook

    for architecture in ARCHITECTURES:
        # Lazy "module:class" form: the model module (and CUDA) is imported only when built.
        ModelRegistry.register_model(architecture, f"swiftkv.vllm.model:{architecture}")
        register_config_hook(architecture, SwiftKVEngineConfig)
    refuse_prompt_logprobs(frozenset(ARCHITECTURES))
