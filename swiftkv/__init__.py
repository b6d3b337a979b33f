"""SwiftKV: prefill-skipping and AcrossKV for Llama, Mistral and Qwen2 chat models.

Importing the package registers the SwiftKV model types (``llama_swiftkv``, ``mistral_swiftkv``,
``qwen2_swiftkv``) with transformers' ``AutoConfig`` and ``AutoModelForCausalLM``.
"""

from swiftkv import modeling  # noqa: F401  (registers the Auto classes)

__version__ = "0.1.0"
