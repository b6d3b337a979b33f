"""Per-replica capacity figures, measured on the hardware a replica runs on (``swiftkv calibrate``).

For every model of a serve config, one Ray task with that model's replica resources (CPUs, GPUs,
environment) starts a vLLM engine configured as the replica's (same ``engine_kwargs``, SwiftKV
prefill skipping as configured, prefix caching off so every prompt token is computed; engine core
and workers in their own processes, as in a replica) and measures:

- prefill throughput, uncached prompt tokens/s, at each input length: ``num_prompts`` random
  prompts submitted at once with one output token each (the median of ``rounds``). The figure at
  the longest length is the ``prefill_tokens_per_s`` the autoscaler and router use;
- decode step time at each batch size: the extra time of ``decode_tokens`` more output tokens.

The result is written as JSON (a profile) and printed as the YAML lines to paste into the config.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from typing import Any

from serve_apps.config import ModelOptions


def _hardware() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})"


def measure_replica(options: ModelOptions, input_lens: list[int], batches: list[int], num_prompts: int,
                    rounds: int, decode_tokens: int = 32) -> dict[str, Any]:
    """Run on the replica's kind of node: start the engine, measure, return the figures."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    from swiftkv.model_source import resolve_model
    from swiftkv.vllm.lifecycle import shutdown_llm

    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = {k: v for k, v in options.engine_kwargs.items() if k in engine_fields}
    kwargs.update(enable_prefix_caching=False,
                  additional_config={"swiftkv": {"prefill_skipping": options.prefill_skipping}})
    llm = LLM(model=resolve_model(options.model), **kwargs)
    try:
        return _measure(llm, options, input_lens, batches, num_prompts, rounds, decode_tokens)
    finally:  # stop the engine-core process now: the Ray worker that ran this task may live on
        shutdown_llm(llm)


def _measure(llm, options: ModelOptions, input_lens: list[int], batches: list[int], num_prompts: int,
             rounds: int, decode_tokens: int) -> dict[str, Any]:
    from benchmarks.bench_vllm import PromptMaker, offline_throughput

    context = llm.llm_engine.vllm_config.model_config.max_model_len
    lens = sorted({min(n, context - decode_tokens - 2) for n in input_lens})
    prompts = PromptMaker(vocab=min(32000, llm.llm_engine.vllm_config.model_config.get_vocab_size()), seed=1)
    for n in lens:  # warm-up at every shape, untimed
        offline_throughput(llm, prompts.batch(-n, num_prompts, n), 1)

    prefill = {}
    for n in lens:
        runs = [offline_throughput(llm, prompts.batch(r * 1000 + n, num_prompts, n), 1) for r in range(rounds)]
        prefill[str(n)] = statistics.median(runs) * n / (n + 1)  # uncached prompt tokens/s (drop the output token)

    decode = {}
    for batch in batches:
        steps = []
        for r in range(rounds):
            batch_prompts = prompts.batch(10**6 + r * 100 + batch, batch, 128)
            start = time.perf_counter()
            offline_throughput(llm, batch_prompts, 1)
            short = time.perf_counter() - start
            start = time.perf_counter()
            offline_throughput(llm, prompts.batch(2 * 10**6 + r * 100 + batch, batch, 128), 1 + decode_tokens)
            steps.append((time.perf_counter() - start - short) / decode_tokens)
        decode[str(batch)] = statistics.median(steps)
    return {
        "model": options.model,
        "hardware": _hardware(),
        "prefill_skipping": options.prefill_skipping,
        "prefill_tokens_per_s": prefill[str(lens[-1])],
        "prefill_tokens_per_s_by_input_len": prefill,
        "decode_step_s_by_batch": decode,
        "num_prompts": num_prompts,
        "rounds": rounds,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def calibrate(models: list[ModelOptions], input_lens: list[int], batches: list[int], num_prompts: int,
              rounds: int) -> dict[str, Any]:
    """Measure every model in a Ray task holding that model's replica resources (in turn, so the
    measurements never share a machine's cores)."""
    import ray

    if not ray.is_initialized():
        ray.init()
    results = {}
    for options in models:
        task = ray.remote(measure_replica).options(
            num_cpus=options.num_cpus, num_gpus=options.num_gpus, max_retries=0,
            runtime_env={"env_vars": dict(options.env)} if options.env else None,
        )
        results[options.name] = ray.get(task.remote(options, input_lens, batches, num_prompts, rounds))
    return {"models": results}


def format_profile(profile: dict[str, Any]) -> str:
    lines = []
    for name, figures in profile["models"].items():
        by_len = ", ".join(f"{n} tokens: {v:,.0f} tok/s"
                           for n, v in figures["prefill_tokens_per_s_by_input_len"].items())
        by_batch = ", ".join(f"batch {b}: {v * 1e3:.1f} ms" for b, v in figures["decode_step_s_by_batch"].items())
        lines += [f"{name} on {figures['hardware']}:", f"  prefill (uncached) {by_len}",
                  f"  decode step {by_batch}",
                  f"  -> in the serve config, models[name={name}]: prefill_tokens_per_s: "
                  f"{figures['prefill_tokens_per_s']:.0f}"]
    return "\n".join(lines)
