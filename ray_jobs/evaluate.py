"""Quality evaluation as a Ray job: lm-eval on several checkpoints side by side, the paper's tasks,
one Ray task per (model, task) (``swiftkv/evaluation/`` has the pieces).

    python -m ray_jobs.evaluate --config ray_jobs/configs/eval-smollm2-cpu.yaml
    ray job submit --working-dir . -- python -m ray_jobs.evaluate --config ray_jobs/configs/eval-smollm2-cpu.yaml \\
        --set num_gpus=1 --set dtype=bfloat16 --set out=s3://my-bucket/eval/smollm2

Each finished (model, task) is written to ``out/parts/`` at once, so a failed task loses only
itself, and a rerun with the same settings reuses what is there. Then ``results.json``
(``quality[task][model] = {"score", "stderr", "n"}``) and ``report.md`` (the table) are written and
the table printed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sys
from typing import Any

import fsspec

from swiftkv.evaluation.config import EvalConfig, TaskSpec
from swiftkv.evaluation.report import format_table
from swiftkv.model_source import checkpoint_stamp
from swiftkv.outputs import write_files
from swiftkv.yaml_config import job_main

log = logging.getLogger("ray_jobs.evaluate")


def part_key(cfg: EvalConfig, model: str, spec: TaskSpec) -> str:
    """What a saved part depends on: a rerun reuses it only if all of this is unchanged (the
    checkpoint's contents included: one saved again at the same path is evaluated again)."""
    settings = cfg.model_dump(include={"backend", "data", "limit", "apply_chat_template", "dtype", "max_length",
                                       "max_gen_toks", "seed", "vllm_kwargs"})
    blob = json.dumps({"model": checkpoint_stamp(cfg.models[model]), "task": spec.model_dump(), **settings},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def _part_path(root: str, model: str, spec: TaskSpec) -> str:
    return f"{root}/parts/{_slug(model)}__{_slug(spec.name)}.json"


def run(cfg: EvalConfig) -> dict[str, Any]:
    import ray
    from tqdm import tqdm

    from swiftkv.evaluation.harness import evaluate_one

    if not ray.is_initialized():
        ray.init()
    fs, root = fsspec.core.url_to_fs(cfg.out)
    fs.makedirs(f"{root}/parts", exist_ok=True)
    quality: dict[str, dict[str, Any]] = {spec.name: {} for spec in cfg.tasks}
    task = ray.remote(evaluate_one).options(num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus, max_retries=0)
    pending: dict[Any, tuple[str, TaskSpec]] = {}
    for model, ref in cfg.models.items():
        for spec in cfg.tasks:
            path = _part_path(root, model, spec)
            if fs.exists(path) and (saved := json.loads(fs.cat(path)))["key"] == part_key(cfg, model, spec):
                log.info("reusing %s / %s from %s", model, spec.name, path)
                quality[spec.name][model] = saved["result"]
            else:
                pending[task.remote(ref, spec, cfg)] = (model, spec)
    with tqdm(total=len(pending), desc="lm-eval (model x task)", unit="run") as bar:
        while pending:
            [done], _ = ray.wait(list(pending), num_returns=1)
            model, spec = pending.pop(done)
            try:
                result = ray.get(done)
            except Exception as err:  # one failed run must not lose the others
                result = {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:500]}"}
                log.error("%s / %s failed: %s", model, spec.name, result["error"])
            if "score" in result:  # failures are reported, not saved: a rerun tries them again
                fs.pipe_file(_part_path(root, model, spec),
                             json.dumps({"key": part_key(cfg, model, spec), "result": result}).encode())
            quality[spec.name][model] = result
            bar.set_postfix_str(f"{model} / {spec.name}: {result.get('score', 'n/a')}")
            bar.update()
    results = {"models": cfg.models, "tasks": [s.name for s in cfg.tasks],
               "task_specs": {s.name: s.model_dump() for s in cfg.tasks}, "quality": quality,
               "config": cfg.model_dump()}
    table = format_table(results)
    report = f"# swiftkv quality ({cfg.backend} backend, {cfg.data} data)\n\n{table}\n"
    write_files(cfg.out, {"results.json": json.dumps(results, indent=2).encode(), "report.md": report.encode()})
    print(table)
    print(f"\nwrote results.json and report.md to {cfg.out}")
    return results


def main(argv: list[str] | None = None) -> int:
    return job_main("python -m ray_jobs.evaluate", __doc__.split("\n\n")[0], EvalConfig, run, argv,
                    what="evaluation config", config_help="YAML config (default: every field's default)")


if __name__ == "__main__":
    sys.exit(main())
