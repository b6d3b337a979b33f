"""Benchmarks run by hand: Hugging Face prefill time (``bench_prefill.py``), the distillation step
(``bench_distill.py``), the Ray Data pipeline (``bench_data.py``) and the distillation curve's plot
(``plot_distill_curve.py``). Each prints ratios measured side by side in one run and writes its
figures as JSON. Nothing imports this package: what a benchmark shares with product code lives there
(the random Llamas in ``swiftkv/random_llama.py``); the vLLM engines side by side are a job of the
main pipeline (``ray_jobs/benchmark.py``, ``ray_jobs/bench_vllm.py``)."""
