"""The Ray Serve application: an OpenAI-compatible endpoint of vLLM-backed SwiftKV replicas,
autoscaled and routed on prefill load (``app.py`` builds it; ``config.py`` is its typed config)."""
