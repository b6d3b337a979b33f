"""SwiftKV: prefill-skipping and AcrossKV for Llama, Mistral, Qwen2, Qwen3 and DeepSeek-V2 chat models.

Importing the package itself is light (the ``swiftkv`` command answers ``--help`` at once);
``import swiftkv.modeling`` registers the SwiftKV model types (``llama_swiftkv``,
``mistral_swiftkv``, ``qwen2_swiftkv``, ``qwen3_swiftkv``, ``deepseek_v2_swiftkv``) with transformers'
``AutoConfig`` and ``AutoModelForCausalLM``, and every module of the package that loads models imports it.
"""

__version__ = "0.1.0"
