"""Analysis tools: the FLOPs/KV-memory/parameter cost model (``flops``) and layer similarity (``simscore``)."""
