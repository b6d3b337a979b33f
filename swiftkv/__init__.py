"""SwiftKV: prefill-skipping and AcrossKV for Llama, Mistral and Qwen2 chat models.

Importing the package itself is light (the ``swiftkv`` command answers ``--help`` at once);
``import swiftkv.modeling`` registers the SwiftKV model types (``llama_swiftkv``,
``mistral_swiftkv``, ``qwen2_swiftkv``) with transformers' ``AutoConfig`` and
``AutoModelForCausalLM``, and every module of the package that loads models imports it.
"""

__version__ = "0.1.0"
