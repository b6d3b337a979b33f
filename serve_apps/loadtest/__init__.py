"""The serving load test: side-by-side comparisons through the Serve application, driven by vLLM's
own benchmark client (``ray_jobs/loadtest.py`` runs it as a Ray job)."""
