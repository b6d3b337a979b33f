"""Hugging Face SwiftKV model classes, registered with transformers' Auto classes on import."""

from transformers import AutoConfig, AutoModelForCausalLM

from swiftkv.modeling.deepseek_v2 import DeepseekV2SwiftKVConfig, DeepseekV2SwiftKVForCausalLM
from swiftkv.modeling.llama import LlamaSwiftKVConfig, LlamaSwiftKVForCausalLM
from swiftkv.modeling.mistral import MistralSwiftKVConfig, MistralSwiftKVForCausalLM
from swiftkv.modeling.qwen2 import Qwen2SwiftKVConfig, Qwen2SwiftKVForCausalLM
from swiftkv.modeling.qwen3 import Qwen3SwiftKVConfig, Qwen3SwiftKVForCausalLM

# base model_type -> (SwiftKV config class, SwiftKV causal-LM class)
FAMILIES = {
    "llama": (LlamaSwiftKVConfig, LlamaSwiftKVForCausalLM),
    "mistral": (MistralSwiftKVConfig, MistralSwiftKVForCausalLM),
    "qwen2": (Qwen2SwiftKVConfig, Qwen2SwiftKVForCausalLM),
    "qwen3": (Qwen3SwiftKVConfig, Qwen3SwiftKVForCausalLM),
    "deepseek_v2": (DeepseekV2SwiftKVConfig, DeepseekV2SwiftKVForCausalLM),
}

for _config_cls, _model_cls in FAMILIES.values():
    AutoConfig.register(_config_cls.model_type, _config_cls, exist_ok=True)
    AutoModelForCausalLM.register(_config_cls, _model_cls, exist_ok=True)

__all__ = [
    "DeepseekV2SwiftKVConfig",
    "DeepseekV2SwiftKVForCausalLM",
    "FAMILIES",
    "LlamaSwiftKVConfig",
    "LlamaSwiftKVForCausalLM",
    "MistralSwiftKVConfig",
    "MistralSwiftKVForCausalLM",
    "Qwen2SwiftKVConfig",
    "Qwen2SwiftKVForCausalLM",
    "Qwen3SwiftKVConfig",
    "Qwen3SwiftKVForCausalLM",
]
