"""The serving load test as a Ray job: deploys the Serve application's variants on the cluster and
replays request mixes against them over loopback with vLLM's own benchmark client
(``serve_apps/loadtest/`` says what is compared and how).

    python -m ray_jobs.loadtest --config ray_jobs/configs/loadtest-smollm2-cpu.yaml
    ray job submit --working-dir . -- python -m ray_jobs.loadtest --config ray_jobs/configs/loadtest-smollm2-cpu.yaml

Writes ``results.json`` (every figure, per request class and round), ``report.md`` and
``loadtest.png`` to ``out`` (a folder or any fsspec URI) and prints the report.
"""

from __future__ import annotations

import json
import logging
import sys

from serve_apps.loadtest.config import LoadTestConfig
from serve_apps.loadtest.report import format_report, plot_png
from swiftkv.outputs import write_files
from swiftkv.yaml_config import job_main


def run(cfg: LoadTestConfig) -> dict:
    import ray

    from serve_apps.loadtest.scenarios import run_loadtest

    if not ray.is_initialized():
        ray.init()
    logging.getLogger("swiftkv.loadtest").setLevel(logging.INFO)
    results = run_loadtest(cfg)
    report = format_report(results)
    write_files(cfg.out, {"results.json": json.dumps(results, indent=2).encode(), "report.md": report.encode(),
                          "loadtest.png": plot_png(results)})
    print(report)
    print(f"wrote results.json, report.md and loadtest.png to {cfg.out}")
    return results


def main(argv: list[str] | None = None) -> int:
    return job_main("python -m ray_jobs.loadtest", __doc__.split("\n\n")[0], LoadTestConfig, run, argv,
                    what="load test config", config_help="YAML config (default: every field's default)")


if __name__ == "__main__":
    sys.exit(main())
