"""vLLM serving benchmark as a Ray job: the base model, SwiftKV and SwiftKV + AcrossKV on the same
weights, measured side by side (``ray_jobs/bench_vllm.py`` says what and how).

    python -m ray_jobs.benchmark --config ray_jobs/configs/bench-smollm2-cpu.yaml
    ray job submit --working-dir . -- python -m ray_jobs.benchmark \\
        --config ray_jobs/configs/bench-llama-3.1-8b-gpu.yaml --set out=s3://my-bucket/bench/8b

The measurement runs in one Ray task that reserves the GPUs (or CPUs) it needs, so on a cluster it
lands on a node that has them; the driver writes ``results.json``, ``report.txt`` and
``throughput_ratio.png`` to ``out`` (a folder or any fsspec URI) and prints the report.
"""

from __future__ import annotations

import json
import sys

from ray_jobs.bench_vllm import ServingBenchConfig, format_report, plot_png, run_benchmark
from swiftkv.outputs import write_files
from swiftkv.yaml_config import job_main


def run(cfg: ServingBenchConfig) -> dict:
    import ray

    from swiftkv.ray_workers import remote_in_own_workers

    if not ray.is_initialized():
        ray.init()
    task = remote_in_own_workers(run_benchmark, "benchmark", num_cpus=cfg.cpus,
                                 num_gpus=cfg.tensor_parallel_size if cfg.use_gpu else 0, max_retries=0)
    result = ray.get(task.remote(cfg))
    report = format_report(result)
    write_files(cfg.out, {"results.json": json.dumps(result, indent=2).encode(),
                          "report.txt": report.encode() + b"\n", "throughput_ratio.png": plot_png(result)})
    print(report)
    print(f"\nwrote results.json, report.txt and throughput_ratio.png to {cfg.out}")
    return result


def main(argv: list[str] | None = None) -> int:
    return job_main("python -m ray_jobs.benchmark", __doc__.split("\n\n")[0], ServingBenchConfig, run, argv,
                    what="benchmark config", config_help="YAML config (default: every field's default)")


if __name__ == "__main__":
    sys.exit(main())
