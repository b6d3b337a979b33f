"""Per-replica capacity figures, measured on the hardware a replica runs on (``swiftkv calibrate``).

For every model of a serve config, one Ray task with that model's replica resources (CPUs, GPUs,
environment) starts a vLLM engine configured as the replica's (same ``engine_kwargs``, SwiftKV
prefill skipping as configured, prefix caching off so every prompt token is computed; engine core
and workers in their own processes, as in a replica) and measures:

- prefill throughput, uncached prompt tokens/s, at each input length: ``num_prompts`` random
  prompts submitted at once with one output token each (the median of ``rounds``). The figure at
  the longest length is the ``prefill_tokens_per_s`` the autoscaler and router use;
- decode step time at each batch size (128-token prompts), and at each context length for the
  largest batch: the extra time of ``decode_tokens`` more output tokens;
- the engine's own limits: KV-cache capacity in tokens, token budget per step, sequence cap, and
  how long the engine took to start.

With ``side_by_side`` N, N copies of each replica are placed on one node together (a Ray placement
group), start their engines, wait for each other and measure at the same time; each figure is their
median. That is the figure for N replicas sharing one host's CPUs or memory bandwidth, which run
slower together than one alone (on this 2-core machine two SmolLM2 replicas side by side decode 1.5
times slower and prefill 1.2-1.3 times slower than one).

The result is written as JSON, a profile the fleet simulator reads (``serve_apps/fleet/profile.py``),
and printed as the YAML lines to paste into the config.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from typing import Any

from serve_apps.config import ModelOptions

DECODE_BATCH_CONTEXT = 128  # prompt tokens of the decode-by-batch points


def _hardware() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})"


class StartLine:
    """A Ray actor the side-by-side copies report to once their engines are up, so that they
    measure together, not while another is still starting."""

    def __init__(self, copies: int) -> None:
        self.copies, self.arrived = copies, 0

    def arrive(self) -> None:
        self.arrived += 1

    def all_arrived(self) -> bool:
        return self.arrived >= self.copies


def _wait_for_the_others(start_line, timeout_s: float = 900.0) -> None:
    import ray

    ray.get(start_line.arrive.remote())
    deadline = time.monotonic() + timeout_s
    while not ray.get(start_line.all_arrived.remote()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the side-by-side copies did not all start their engines within {timeout_s:.0f} s")
        time.sleep(0.2)


def measure_replica(options: ModelOptions, input_lens: list[int], batches: list[int], num_prompts: int,
                    rounds: int, decode_contexts: list[int], decode_tokens: int = 32,
                    start_line=None) -> dict[str, Any]:
    """Run on the replica's kind of node: start the engine, (side by side: wait for the other
    copies' engines), measure, return the figures."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    from serve_apps.vllm_app import served_engine_config
    from swiftkv.model_source import resolve_model
    from swiftkv.vllm.lifecycle import shutdown_llm

    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = {k: v for k, v in options.engine_kwargs.items() if k in engine_fields}
    path = resolve_model(options.model)
    # The replica's scheduler limits, not the offline LLM class's defaults (on CPU twice the tokens
    # per step): the figures are of the engine the replica runs.
    served = served_engine_config(options, path)[1].scheduler_config
    kwargs.update(enable_prefix_caching=False, max_num_batched_tokens=served.max_num_batched_tokens,
                  max_num_seqs=served.max_num_seqs,
                  additional_config={"swiftkv": {"prefill_skipping": options.prefill_skipping}})
    start = time.perf_counter()
    llm = LLM(model=path, **kwargs)
    startup_s = time.perf_counter() - start
    try:
        if start_line is not None:
            _wait_for_the_others(start_line)
        figures = _measure(llm, options, input_lens, batches, num_prompts, rounds, decode_contexts, decode_tokens)
        return {**figures, "startup_s": startup_s}
    finally:  # stop the engine-core process now: the Ray worker that ran this task may live on
        shutdown_llm(llm)


def _decode_step_s(llm, prompts, batch: int, context: int, rounds: int, decode_tokens: int, salt: int) -> float:
    """Median over rounds of the extra seconds per output token of ``batch`` sequences of ``context``
    prompt tokens (fresh prompts every run, so no prefix cache helps)."""
    from serve_apps.offline_timing import offline_throughput

    steps = []
    for r in range(rounds):
        start = time.perf_counter()
        offline_throughput(llm, prompts.batch(salt + r * 100 + batch, batch, context), 1)
        short = time.perf_counter() - start
        start = time.perf_counter()
        offline_throughput(llm, prompts.batch(salt + 10**6 + r * 100 + batch, batch, context), 1 + decode_tokens)
        steps.append((time.perf_counter() - start - short) / decode_tokens)
    return statistics.median(steps)


def _measure(llm, options: ModelOptions, input_lens: list[int], batches: list[int], num_prompts: int,
             rounds: int, decode_contexts: list[int], decode_tokens: int) -> dict[str, Any]:
    from serve_apps.offline_timing import PromptMaker, offline_throughput

    context = llm.llm_engine.vllm_config.model_config.max_model_len
    lens = sorted({min(n, context - decode_tokens - 2) for n in input_lens})
    prompts = PromptMaker(vocab=min(32000, llm.llm_engine.vllm_config.model_config.get_vocab_size()), seed=1)
    for n in lens:  # warm-up at every shape, untimed
        offline_throughput(llm, prompts.batch(-n, num_prompts, n), 1)
    timed_from = time.time()

    prefill = {}
    for n in lens:
        runs = [offline_throughput(llm, prompts.batch(r * 1000 + n, num_prompts, n), 1) for r in range(rounds)]
        prefill[str(n)] = statistics.median(runs) * n / (n + 1)  # uncached prompt tokens/s (drop the output token)

    decode = {str(b): _decode_step_s(llm, prompts, b, DECODE_BATCH_CONTEXT, rounds, decode_tokens, 10**7)
              for b in batches}
    context_batch = max(batches)
    contexts = sorted({min(n, context - decode_tokens - 2) for n in decode_contexts})
    by_context = {str(n): _decode_step_s(llm, prompts, context_batch, n, rounds, decode_tokens, 10**8 + n)
                  for n in contexts}
    config = llm.llm_engine.vllm_config
    return {
        "model": options.model,
        "hardware": _hardware(),
        "prefill_skipping": options.prefill_skipping,
        "prefill_tokens_per_s": prefill[str(lens[-1])],
        "prefill_tokens_per_s_by_input_len": prefill,
        "decode_step_s_by_batch": decode,
        "decode_context_tokens": DECODE_BATCH_CONTEXT,
        "decode_step_s_by_context": by_context,
        "decode_context_batch": context_batch,
        "kv_cache_tokens": config.cache_config.num_gpu_blocks * config.cache_config.block_size,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "num_prompts": num_prompts,
        "rounds": rounds,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "timed_unix": [timed_from, time.time()],
    }


def median_of_copies(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One replica's figures from its side-by-side copies: the median of every number that differs
    between them (per key in the by-length/by-batch tables); everything else as the first copy has it."""
    first = runs[0]
    merged: dict[str, Any] = {}
    for key, value in first.items():
        if isinstance(value, dict):
            merged[key] = {k: statistics.median(run[key][k] for run in runs) for k in value}
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and any(r[key] != value for r in runs):
            merged[key] = statistics.median(run[key] for run in runs)
        else:
            merged[key] = value
    return {**merged, "side_by_side": len(runs)}


def _all_or_first_error(refs: list) -> list:
    """The tasks' results. ``ray.get`` raises at the first failure; the other copies are then
    cancelled, not left waiting at the start line for a copy that never comes."""
    import ray

    try:
        return ray.get(refs)
    except Exception:
        # Only the copies still running: cancelling the one that just failed races Ray's own
        # completion of it, which Ray 2.60 answers by aborting this process ("Tried to complete task
        # that was not pending", seen once in the test of this).
        _, running = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in running:
            ray.cancel(ref, force=True)
        raise


def _pack_on_one_node(options: ModelOptions, copies: int, timeout_s: float):
    """A placement group of ``copies`` bundles of the replica's resources, all on one node."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = {"CPU": options.num_cpus, "GPU": options.num_gpus}
    bundle = {k: v for k, v in bundle.items() if v > 0}
    if not bundle:
        raise ValueError(f"side by side, the replicas of {options.name!r} need num_cpus or num_gpus > 0 to be "
                         "placed together")
    group = placement_group([bundle] * copies, strategy="STRICT_PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(f"cannot place {copies} replicas of {options.name!r} ({bundle} each) on one node within "
                           f"{timeout_s:.0f} s; the cluster has {ray.cluster_resources()}")
    return group


def calibrate(models: list[ModelOptions], input_lens: list[int], batches: list[int], num_prompts: int,
              rounds: int, decode_contexts: list[int], side_by_side: int = 1,
              placement_timeout_s: float = 120.0) -> dict[str, Any]:
    """Measure every model in turn (different models never share a machine's cores), in Ray tasks
    holding that model's replica resources: one, or ``side_by_side`` at once packed on one node."""
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init()
    results = {}
    for options in models:
        group = _pack_on_one_node(options, side_by_side, placement_timeout_s) if side_by_side > 1 else None
        try:
            start_line = ray.remote(num_cpus=0)(StartLine).remote(side_by_side) if group else None
            refs = [
                ray.remote(measure_replica).options(
                    num_cpus=options.num_cpus, num_gpus=options.num_gpus, max_retries=0,
                    runtime_env={"env_vars": dict(options.env)} if options.env else None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, i) if group else None,
                ).remote(options, input_lens, batches, num_prompts, rounds, decode_contexts, start_line=start_line)
                for i in range(side_by_side)
            ]
            runs = _all_or_first_error(refs)
        finally:
            if group:
                remove_placement_group(group)
        results[options.name] = median_of_copies(runs) if group else runs[0]
    return {"models": results}


def format_profile(profile: dict[str, Any]) -> str:
    lines = []
    for name, figures in profile["models"].items():
        by_len = ", ".join(f"{n} tokens: {v:,.0f} tok/s"
                           for n, v in figures["prefill_tokens_per_s_by_input_len"].items())
        by_batch = ", ".join(f"batch {b}: {v * 1e3:.1f} ms" for b, v in figures["decode_step_s_by_batch"].items())
        by_context = ", ".join(f"{n} tokens: {v * 1e3:.1f} ms" for n, v in figures["decode_step_s_by_context"].items())
        copies = figures.get("side_by_side", 1)
        where = f" ({copies} side by side, medians)" if copies > 1 else ""
        lines += [f"{name} on {figures['hardware']}{where}:", f"  prefill (uncached) {by_len}",
                  f"  decode step {by_batch}; at batch {figures['decode_context_batch']} with contexts of "
                  f"{by_context}",
                  f"  engine: {figures['kv_cache_tokens']:,} KV tokens, {figures['max_num_batched_tokens']} tokens "
                  f"per step, {figures['max_num_seqs']} sequences, started in {figures['startup_s']:.0f} s",
                  f"  -> in the serve config, models[name={name}]: prefill_tokens_per_s: "
                  f"{figures['prefill_tokens_per_s']:.0f}"]
    return "\n".join(lines)
