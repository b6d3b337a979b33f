"""Serving SwiftKV checkpoints with vLLM 0.32: the plugin entry point (``plugin.register``), the
model (``model``), and the few touches of vLLM internals it needs (``kv_internals``)."""
