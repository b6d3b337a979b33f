"""Benchmarks, one home for all of them: Hugging Face prefill time (``bench_prefill.py``), the
distillation step (``bench_distill.py``), the vLLM engines side by side (``bench_vllm.py``, run as
the Ray job ``ray_jobs/benchmark.py``), and the random Llama they share (``random_llama.py``).
Each prints ratios measured side by side in one run and writes its figures as JSON."""
