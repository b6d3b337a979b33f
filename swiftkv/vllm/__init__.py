"""Serving SwiftKV checkpoints with vLLM 0.32: the plugin entry point (``plugin.register``), the
models (``model``; ``deepseek_v2`` for latent attention), and the few touches of vLLM internals
they need (``kv_internals``)."""
