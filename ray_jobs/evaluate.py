"""Quality evaluation as a Ray job: lm-eval on several checkpoints side by side (the paper's tasks),
needle retrieval by prompt length and agreement turn by turn, one Ray task per (model, task)
(``swiftkv/evaluation/`` has the pieces).

    python -m ray_jobs.evaluate --config ray_jobs/configs/eval-smollm2-cpu.yaml
    ray job submit --working-dir . -- python -m ray_jobs.evaluate --config ray_jobs/configs/eval-smollm2-cpu.yaml \\
        --set num_gpus=1 --set dtype=bfloat16 --set out=s3://my-bucket/eval/smollm2

Each finished (model, task) is written to ``out/parts/`` at once, so a failed task loses only
itself, and a rerun with the same settings reuses what is there. Then ``results.json``
(``quality[task][model] = {"score", "stderr", "n"}``, ``long_context[model]``, ``multi_turn[model]``),
``report.md`` (the tables), ``needle.png`` and ``multiturn.png`` are written and the tables printed.
With a ``gate`` section the quality gate's PASS/FAIL lines come first in the report and in
``results.json`` (``gate``), and go into the judged checkpoint's model card when it is a local folder
with one (``swiftkv.model_card``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import fsspec

from swiftkv.evaluation.config import EvalConfig
from swiftkv.evaluation.gate import format_gate, judge
from swiftkv.evaluation.report import format_report
from swiftkv.model_card import write_gate
from swiftkv.model_source import checkpoint_stamp
from swiftkv.outputs import write_files
from swiftkv.yaml_config import job_main

log = logging.getLogger("ray_jobs.evaluate")

NEEDLE, MULTITURN = "long-context needle", "multi-turn"


def part_key(cfg: EvalConfig, model: str, name: str) -> str:
    """What a saved part depends on: a rerun reuses it only if all of this is unchanged (the
    checkpoint's contents included: one saved again at the same path is evaluated again)."""
    if name == NEEDLE:
        settings = cfg.model_dump(include={"needle", "dtype", "seed"})
    elif name == MULTITURN:
        settings = cfg.model_dump(include={"multiturn", "dtype", "seed"})
    else:
        spec = next(s for s in cfg.tasks if s.name == name)
        settings = {"task": spec.model_dump(), **cfg.model_dump(
            include={"backend", "data", "limit", "apply_chat_template", "dtype", "max_length", "max_gen_toks",
                     "seed", "vllm_kwargs"})}
    blob = json.dumps({"model": checkpoint_stamp(cfg.models[model]), "part": name, **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def _part_path(root: str, model: str, name: str) -> str:
    return f"{root}/parts/{_slug(model)}__{_slug(name)}.json"


def _probe(kind: str, model_ref: str, cfg: EvalConfig) -> dict[str, Any]:
    """Needle retrieval or the multi-turn figures of one model (a Ray task)."""
    from swiftkv.model_source import resolve_model

    path = resolve_model(model_ref)
    if kind == NEEDLE:
        from swiftkv.evaluation.needle import run_needle

        return run_needle(path, cfg.needle, cfg.dtype, cfg.seed)
    from swiftkv.evaluation.multiturn import run_multiturn

    return run_multiturn(path, cfg.multiturn, cfg.dtype, cfg.seed)


def _error(err: Exception) -> dict[str, str]:
    return {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:500]}"}


def run(cfg: EvalConfig) -> dict[str, Any]:
    import ray
    from tqdm import tqdm

    from swiftkv.evaluation.harness import evaluate_one
    from swiftkv.ray_workers import remote_in_own_workers

    if not ray.is_initialized():
        ray.init()
    fs, root = fsspec.core.url_to_fs(cfg.out)
    fs.makedirs(f"{root}/parts", exist_ok=True)
    options = {"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus, "max_retries": 0}
    lm_eval_task = remote_in_own_workers(evaluate_one, "evaluate", **options)
    probe_task = remote_in_own_workers(_probe, "evaluate", **options)
    parts: dict[str, dict[str, Any]] = {s.name: {} for s in cfg.tasks}
    probes = [name for name, on in ((NEEDLE, cfg.needle), (MULTITURN, cfg.multiturn)) if on is not None]
    parts.update({name: {} for name in probes})
    pending: dict[Any, tuple[str, str]] = {}
    # Row by row (every model on a task before the next task), so a table cut short is still comparable.
    work = [(s.name, model, lm_eval_task, (ref, s, cfg)) for s in cfg.tasks for model, ref in cfg.models.items()]
    probed = {m: ref for m, ref in cfg.models.items() if cfg.probe_models is None or m in cfg.probe_models}
    work += [(name, model, probe_task, (name, ref, cfg)) for name in probes for model, ref in probed.items()]
    for name, model, task, args in work:
        path = _part_path(root, model, name)
        if fs.exists(path) and (saved := json.loads(fs.cat(path)))["key"] == part_key(cfg, model, name):
            log.info("reusing %s / %s from %s", model, name, path)
            parts[name][model] = saved["result"]
        else:
            pending[task.remote(*args)] = (model, name)
    with tqdm(total=len(pending), desc="evaluation (model x task)", unit="run") as bar:
        while pending:
            [done], _ = ray.wait(list(pending), num_returns=1)
            model, name = pending.pop(done)
            try:
                result = ray.get(done)
            except Exception as err:  # one failed run must not lose the others
                result = _error(err)
                log.error("%s / %s failed: %s", model, name, result["error"])
            if "error" not in result and "unavailable" not in result:  # a rerun tries failures again
                fs.pipe_file(_part_path(root, model, name),
                             json.dumps({"key": part_key(cfg, model, name), "result": result}).encode())
            parts[name][model] = result
            bar.set_postfix_str(f"{model} / {name}: {result.get('score', 'done')}")
            bar.update()
    results = {"models": cfg.models, "tasks": [s.name for s in cfg.tasks],
               "task_specs": {s.name: s.model_dump() for s in cfg.tasks},
               "quality": {s.name: parts[s.name] for s in cfg.tasks},
               "long_context": parts.get(NEEDLE, {}), "multi_turn": parts.get(MULTITURN, {}),
               "config": cfg.model_dump()}
    gate = ""
    if cfg.gate is not None:
        results["gate"] = judge(results, cfg.gate)
        gate = format_gate(results["gate"]) + "\n\n"
        judged = cfg.models[cfg.gate.model]
        if Path(judged).is_dir() and write_gate(judged, gate):
            log.info("wrote the gate into the model card of %s", judged)
    report = f"# swiftkv quality ({cfg.backend} backend, {cfg.data} data)\n\n{gate}{format_report(results)}\n"
    write_files(cfg.out, {"results.json": json.dumps(results, indent=2).encode(), "report.md": report.encode(),
                          **plots(results)})
    print(report)
    print(f"wrote results.json, report.md and the plots to {cfg.out}")
    return results


def plots(results: dict[str, Any]) -> dict[str, bytes]:
    """``quality.png``, ``needle.png`` and ``multiturn.png``, for what produced figures."""
    from swiftkv.evaluation.multiturn import plot_multiturn
    from swiftkv.evaluation.needle import plot_needle
    from swiftkv.evaluation.report import plot_quality

    out = {}
    if any("score" in part for task in results["quality"].values() for part in task.values()):
        out["quality.png"] = plot_quality(results)
    if any("cells" in r for r in results["long_context"].values()):
        out["needle.png"] = plot_needle(results["long_context"])
    if any("recall" in r for r in results["multi_turn"].values()):
        out["multiturn.png"] = plot_multiturn(results["multi_turn"])
    return out


def main(argv: list[str] | None = None) -> int:
    return job_main("python -m ray_jobs.evaluate", __doc__.split("\n\n")[0], EvalConfig, run, argv,
                    what="evaluation config", config_help="YAML config (default: every field's default)")


if __name__ == "__main__":
    sys.exit(main())
