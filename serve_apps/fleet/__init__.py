"""Fleet simulation: a request trace replayed through N simulated vLLM replicas, autoscaled and
routed by the very code Ray Serve runs (``serve_apps/policy.py``, ``serve_apps/router.py``, Serve's
own request-count policy and power-of-two router).

One job per module: ``trace`` (the Mooncake trace format, slicing and scaling), ``synthetic``
(Poisson traffic for sweeps), ``config`` (typed configs; traffic building), ``profile`` (per-replica
figures: measured by ``swiftkv calibrate`` or derived), ``paper_profile`` (the H100 profile derived
from the paper), ``replica`` (one replica's engine: a fluid model of vLLM's chunked-prefill scheduler
with an LRU prefix cache), ``serve_control`` (Serve's policy and router classes on the simulated
clock), ``simulator`` (the event loop), ``results`` (figures of a run), ``plots`` (the timeline),
``run`` (``swiftkv fleet simulate``), ``report`` (the comparison grid and its table), ``replay`` and
``validate`` (the same trace against a real endpoint).
"""
