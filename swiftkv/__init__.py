"""SwiftKV: prefill-skipping and AcrossKV for Llama, Mistral, Qwen2, Qwen3 and DeepSeek-V2 chat models.

``import swiftkv`` registers the SwiftKV model types (``llama_swiftkv``, ``mistral_swiftkv``,
``qwen2_swiftkv``, ``qwen3_swiftkv``, ``deepseek_v2_swiftkv``) with transformers' ``AutoConfig`` and
``AutoModelForCausalLM``, so ``AutoModelForCausalLM.from_pretrained`` loads SwiftKV checkpoints. It
does so lazily, when the program first uses transformers' Auto classes (``swiftkv.auto_registration``):
importing the package itself stays light, and the ``swiftkv`` command answers ``--help`` at once.
"""

from swiftkv.auto_registration import register_when_used

__version__ = "0.1.0"

register_when_used()
