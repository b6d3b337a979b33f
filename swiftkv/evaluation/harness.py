"""One evaluation: one model on one task with lm-eval, on the configured backend (run as a Ray task
by ``ray_jobs/evaluate.py``)."""

from __future__ import annotations

import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from swiftkv.evaluation.config import EvalConfig, TaskSpec

log = logging.getLogger(__name__)


def build_lm(path: str, cfg: EvalConfig, generative: bool):
    """lm-eval's model object for ``path``: ``HFLM`` on our HF classes (a full forward gives every
    position's logits; ``generate`` skips the prefill), or vLLM with our plugin."""
    if cfg.backend == "vllm":
        from swiftkv.evaluation.vllm_backend import vllm_lm

        return vllm_lm(path, cfg.dtype, cfg.max_length, prefill_skipping=generative, seed=cfg.seed,
                       **cfg.vllm_kwargs)
    from lm_eval.models.huggingface import HFLM

    from swiftkv.inference import load_chat_model

    model, tokenizer = load_chat_model(path, cfg.dtype)
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.batch_size, max_length=cfg.max_length)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def extract_score(results: dict[str, Any], spec: TaskSpec) -> dict[str, Any]:
    """``{"score", "stderr", "n", "per_doc"}`` of ``spec``'s metric from ``simple_evaluate``'s results (a
    group's score is lm-eval's own aggregate over its subtasks; ``n`` counts every document scored;
    ``per_doc`` is each document's value, when lm-eval's samples carry it)."""
    row = results["results"][spec.task]
    key = f"{spec.metric},{spec.filter}"
    if key not in row:
        reported = sorted(k for k in row if "," in k and "_stderr" not in k)
        raise ValueError(f"lm-eval reported no {key!r} for {spec.task} (it reported {reported})")
    n = sum(int(v["effective"]) for v in results["n-samples"].values())
    score = {"score": _number(row[key]), "stderr": _number(row.get(f"{spec.metric}_stderr,{spec.filter}")), "n": n}
    per_doc = _per_doc(results.get("samples") or {}, spec)
    return {**score, "per_doc": per_doc} if per_doc is not None else score


def _per_doc(samples: dict[str, list[dict[str, Any]]], spec: TaskSpec) -> list[float] | None:
    """Each document's metric, ordered by (task, document id): the same questions in the same order
    for every model scored with the same task and limit, so that two models can be compared question
    by question (``gate.recovered_share``). ``None`` when a sample does not carry the metric."""
    rows = [(task, s["doc_id"], s.get(spec.metric)) for task, task_samples in sorted(samples.items())
            for s in task_samples if s.get("filter", spec.filter) == spec.filter]
    if not rows or any(_number(value) is None for *_, value in rows):
        return None
    return [float(value) for *_, value in sorted(rows, key=lambda r: (r[0], r[1]))]


def evaluate_one(model_ref: str, spec: TaskSpec, cfg: EvalConfig) -> dict[str, Any]:
    """Evaluate one model on one task; a task with no offline copy is reported unavailable."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from swiftkv.evaluation.offline_data import offline_task_manager
    from swiftkv.model_source import resolve_model
    from swiftkv.vllm.lifecycle import shutdown_llm

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="swiftkv-lm-eval-tasks-") as overrides:
        if cfg.data == "offline":
            manager, offline = offline_task_manager(Path(overrides))
            if spec.task not in offline:
                return {"unavailable": f"no offline copy of {spec.task} here (data: hub needs the dataset hub)"}
        else:
            manager = TaskManager()
        lm = build_lm(resolve_model(model_ref), cfg, spec.generative)
        gen_kwargs = {"max_gen_toks": cfg.max_gen_toks} if spec.generative and cfg.max_gen_toks else None
        limit = spec.limit or cfg.limit
        log.info("lm-eval: %s on %s (%d-shot, %s backend, limit %s)", model_ref, spec.task, spec.num_fewshot,
                 cfg.backend, limit)
        try:
            results = simple_evaluate(
                model=lm, tasks=[spec.task], num_fewshot=spec.num_fewshot, limit=limit, task_manager=manager,
                apply_chat_template=cfg.apply_chat_template, fewshot_as_multiturn=cfg.apply_chat_template,
                gen_kwargs=gen_kwargs, log_samples=True, random_seed=cfg.seed, numpy_random_seed=cfg.seed,
                torch_random_seed=cfg.seed, fewshot_random_seed=cfg.seed, bootstrap_iters=1000,
            )
        finally:
            if cfg.backend == "vllm":  # stop the engine-core process: the Ray worker may live on
                shutdown_llm(lm.model)
    return {**extract_score(results, spec), "seconds": round(time.monotonic() - started, 1)}
