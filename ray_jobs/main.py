"""The main job, end to end: choose the cutoff (SimScore), distil on Ray Train, check the result in
Hugging Face and in vLLM, and write a report.

    python -m ray_jobs.main                  # embedded default: local Ray, bundled SmolLM2, bundled chat data
    ray job submit --working-dir . -- python -m ray_jobs.main --config ray_jobs/configs/main-smollm2-cpu.yaml

Steps (each writes under ``out``): ``simscore/`` (curve, matrix, suggested cutoffs of the base
model), ``distill/`` (the Ray Train run and its SPEC-format checkpoints), ``report.json`` and
``report.md`` (held-out KL and top-1 agreement before and after distillation, the teacher's, the
HF student's and vLLM's answers to a few chat prompts).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from pydantic import Field

from swiftkv.yaml_config import StrictConfig, job_main

log = logging.getLogger("ray_jobs.main")

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Give me two tips for sleeping better.",
    "Write a haiku about the sea.",
]


class MainConfig(StrictConfig):
    distill: str = "ray_jobs/configs/smollm2-135m-cpu.yaml"
    """The distillation recipe (see ray_jobs/configs/); its model, cutoff and data are the job's."""

    distill_overrides: list[str] = ["train.max_steps=40"]
    """``key=value`` overrides applied to the recipe, as ``--set`` does for ``ray_jobs.distill``. The
    default halves the CPU recipe's 80 steps (most of the recovery comes in the first 20) so that the
    main job stays around ten minutes on two cores."""

    simscore_samples: int = Field(default=16, gt=0)
    """Bundled chat conversations (chitchat) SimScore runs the base model on."""

    simscore_max_len: int = Field(default=256, gt=8)
    """Tokens per conversation for SimScore."""

    prompts: list[str] = DEFAULT_PROMPTS
    """Chat prompts answered greedily by the teacher, the HF student and vLLM."""

    max_new_tokens: int = Field(default=48, gt=0)
    """Tokens generated per prompt."""

    vllm: bool = True
    """Also serve the distilled checkpoint with vLLM (our plugin) and compare its answers with HF's."""

    out: str = "artifacts/main"
    """Output folder (the distillation's storage path is ``out/distill`` unless the recipe sets an
    ``s3://`` one)."""


def simscore_step(model_path: str, cfg: MainConfig, out: Path) -> dict:
    from swiftkv.analysis.simscore import compute_simscore, save_result

    result = compute_simscore(model_path, "bundled", cfg.simscore_samples, cfg.simscore_max_len, 4, 0.5)
    save_result(result, out / "simscore")
    return {
        "recommended_num_key_value_layers": result.recommended_num_key_value_layers,
        "targets": [t.__dict__ for t in result.targets],
        "tokens": result.num_tokens,
    }


def hf_answers(checkpoint: str, prompts: list[str], max_new_tokens: int) -> dict[str, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftkv.inference import chat_generate

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return {
        "teacher": chat_generate(model.swiftkv(False), tokenizer, prompts, max_new_tokens),
        "student": chat_generate(model.swiftkv(True), tokenizer, prompts, max_new_tokens),
    }


def vllm_answers(checkpoint: str, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    import torch

    if not torch.cuda.is_available():  # CPU: one in-process engine, both cores, a small KV cache
        for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                           ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")):
            os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams

    llm = LLM(model=checkpoint, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                       SamplingParams(temperature=0.0, max_tokens=max_new_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def write_report(report: dict, out: Path) -> Path:
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    d, lines = report["distill"], ["# swiftkv main job", ""]
    lines += [f"- base model: `{report['base_model']}` ({report['num_layers']} layers); cutoff c = "
              f"{report['num_key_value_layers']}, AcrossKV g = {report['key_value_group_size']}",
              f"- SimScore recommends c = {report['simscore']['recommended_num_key_value_layers']} "
              f"(`{out / 'simscore'}`)",
              f"- distillation: {d['steps']} steps; held-out KL {d['heldout_kl_at_start']:.4f} -> "
              f"{d['heldout_kl']:.4f} ({d['heldout_kl'] / d['heldout_kl_at_start']:.2f}x), top-1 agreement "
              f"{d['heldout_top1_at_start']:.3f} -> {d['heldout_top1']:.3f}",
              f"- checkpoint: `{report['checkpoint']}`", ""]
    if "vllm_matches_hf_student" in report:
        lines += [f"- vLLM greedy answers equal to the HF student's: {report['vllm_matches_hf_student']}", ""]
    lines += ["| prompt | teacher | SwiftKV student (HF) |" + (" vLLM |" if "vllm" in report["answers"] else ""),
              "|---|---|---|" + ("---|" if "vllm" in report["answers"] else "")]
    for i, prompt in enumerate(report["prompts"]):
        cells = [report["answers"][k][i].replace("\n", " ") for k in ("teacher", "student", "vllm")
                 if k in report["answers"]]
        lines.append(f"| {prompt} | " + " | ".join(cells) + " |")
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(cfg: MainConfig) -> dict:
    import ray
    from transformers import AutoConfig, AutoTokenizer

    from ray_jobs.distill import run as run_distill
    from swiftkv.distill.config import load_config as load_distill_config
    from swiftkv.distill.train_loop import MODEL_DIR
    from swiftkv.model_source import resolve_model

    out = Path(cfg.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    recipe = load_distill_config(cfg.distill, [f"output.storage_path={out / 'distill'}", *cfg.distill_overrides])
    base = resolve_model(recipe.model)
    num_layers = AutoConfig.from_pretrained(base).num_hidden_layers

    log.info("[1/4] SimScore of %s", base)
    simscore = simscore_step(base, cfg, out)

    log.info("[2/4] distillation on Ray Train (%s)", cfg.distill)
    if not ray.is_initialized():
        ray.init()
    result = run_distill(recipe)
    checkpoint = f"{result.checkpoint.path}/{MODEL_DIR}"
    metrics = {k: v for k, v in result.metrics.items() if k.startswith(("heldout", "step", "loss", "kl"))}
    metrics["steps"] = result.metrics.get("step")

    log.info("[3/4] Hugging Face answers (teacher, student with prefill skipping)")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = hf_answers(checkpoint, cfg.prompts, cfg.max_new_tokens)
    report = {
        "base_model": base, "num_layers": num_layers, "checkpoint": checkpoint,
        "num_key_value_layers": AutoConfig.from_pretrained(checkpoint).num_key_value_layers,
        "key_value_group_size": recipe.key_value_group_size, "simscore": simscore, "distill": metrics,
        "prompts": cfg.prompts,
    }
    if cfg.vllm:
        log.info("[4/4] vLLM answers from the same checkpoint")
        ids["vllm"] = vllm_answers(checkpoint, cfg.prompts, cfg.max_new_tokens)
        same = sum(a == b for a, b in zip(ids["vllm"], ids["student"], strict=True))
        report["vllm_matches_hf_student"] = f"{same}/{len(cfg.prompts)} prompts token for token"
    report["answers"] = {k: [tokenizer.decode(t, skip_special_tokens=True).strip() for t in v] for k, v in ids.items()}
    path = write_report(report, out)
    print(path.read_text())
    return report


def main(argv: list[str] | None = None) -> int:
    return job_main("python -m ray_jobs.main", __doc__.split("\n\n")[0], MainConfig, run, argv,
                    what="main job config", config_help="YAML config (default: the embedded SmolLM2 CPU default)")


if __name__ == "__main__":
    sys.exit(main())
