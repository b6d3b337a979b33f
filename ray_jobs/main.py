"""The main job, end to end: SimScore, convert at the cutoff, distil on Ray Train, evaluate the
base, rewired and distilled models, benchmark prefill, serve the result and ask it, and report.

    python -m ray_jobs.main                  # embedded default: local Ray, bundled SmolLM2, bundled chat data
    python -m ray_jobs.main --set quick=true # every step at a reduced size (CI, a first look)
    ray job submit --working-dir . -- python -m ray_jobs.main --config ray_jobs/configs/main-smollm2-cpu.yaml

Steps (each writes under ``out``): ``simscore/`` (curve, matrix, suggested cutoffs of the base
model), ``rewired/`` (the SwiftKV conversion at the cutoff used), ``distill/`` (the Ray Train run and
its checkpoints), ``eval/`` (the evaluation job's tables and plots for base, rewired and distilled,
and the quality gate on the distilled model, first in the report),
``bench/`` (vLLM prefill benchmark, base vs SwiftKV), ``serve.log`` (``swiftkv serve`` of the base
and the distilled model, asked through the ``openai`` client), then ``report.json`` and ``report.md``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from ray_jobs.main_report import write_report
from swiftkv.yaml_config import StrictConfig, job_main

if TYPE_CHECKING:
    from swiftkv.distill.config import DistillConfig

log = logging.getLogger("ray_jobs.main")

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Give me two tips for sleeping better.",
    "Write a haiku about the sea.",
]

FULL = {"distill": ["train.max_steps=20", "train.eval_every_steps=null", "init.calibration_rows=16"]}
"""The job's own sizes before the configured overrides: 20 of the CPU recipe's 60 steps and the
least-squares start fitted on 16 rows, so that the whole job fits in about 25 minutes on two cores
(the gate at the job's end says what these steps reached)."""

QUICK_MAX_SEQ_LEN = 512
"""Quick mode's longest training row (the retrieval chats included): the least-squares fit and the
steps then take a quarter of the recipe's tokens."""

QUICK = {
    "distill": ["train.max_steps=4", "train.eval_every_steps=null", "output.checkpoint_every_steps=4",
                "init.calibration_rows=5"],
    "evaluate": ["limit=8", "tasks=[{name: ARC-Easy, task: arc_easy, metric: acc_norm}, "
                 "{name: PIQA, task: piqa, metric: acc_norm}]",
                 "needle={lengths: [512, 2048], depths: [0.5], samples: 2}",
                 # One conversation of each kind: the SwiftKV models' probes (teacher and student, HF on
                 # one core each) are the longest part of a quick evaluation.
                 "multiturn={chitchat_conversations: 1, max_turns: 2, mtbench_questions: 1, history_tokens: 16, "
                 "greedy_tokens: 4, recall_gaps: [0, 2], recall_samples: 2}"],
    "benchmark": ["input_lens=[512]", "num_prompts=2", "rounds=1", "latency_requests=2", "latency_input_len=256",
                  "latency_output_len=8"],
}
"""What ``quick: true`` uses instead of ``FULL``, before the configured overrides."""


class MainConfig(StrictConfig):
    distill: str = "ray_jobs/configs/smollm2-135m-cpu.yaml"
    """The distillation recipe (see ray_jobs/configs/); its model, data and group size are the job's."""

    distill_overrides: list[str] = []
    """``key=value`` overrides applied to the recipe, as ``--set`` does for ``ray_jobs.distill``
    (after the job's own ``train.max_steps=20``, or quick mode's 4)."""

    cutoff: Literal["simscore", "recipe"] = "recipe"
    """``recipe``: distil at the recipe's ``num_key_value_layers`` (the shipped recipe's is the deepest
    cutoff that passes the quality gate); ``simscore``: at the cutoff SimScore recommends for the base
    model (the recipe's when it recommends none). The report says which, and SimScore's suggestion."""

    simscore_samples: int = Field(default=16, gt=0)
    """Bundled chat conversations (chitchat) SimScore runs the base model on."""

    simscore_max_len: int = Field(default=256, gt=8)
    """Tokens per conversation for SimScore."""

    evaluate: str = "ray_jobs/configs/eval-main-smollm2-cpu.yaml"
    """The evaluation config (``ray_jobs.evaluate``); the job sets its models (base, rewired,
    distilled) and output folder."""

    evaluate_overrides: list[str] = []
    """``key=value`` overrides of the evaluation config."""

    benchmark: str = "ray_jobs/configs/bench-main-smollm2-cpu.yaml"
    """The vLLM prefill benchmark config (``ray_jobs.benchmark``); the job sets its model and cutoff."""

    benchmark_overrides: list[str] = []
    """``key=value`` overrides of the benchmark config."""

    serve: bool = True
    """Serve the base and the distilled model with ``swiftkv serve`` (its own local Ray, on this
    machine, after the job's Ray work is done) and ask both through the ``openai`` client. On a
    cluster, deploy with ``serve deploy`` instead (docs/serving.md) and set this to false."""

    serve_config: str = "serve_apps/smollm2-cpu.yaml"
    """The Serve config whose first model entry gives both served models their settings."""

    prompts: list[str] = DEFAULT_PROMPTS
    """Chat prompts answered greedily by the teacher and student in Hugging Face and by the served model."""

    max_new_tokens: int = Field(default=48, gt=0)
    """Tokens generated per prompt."""

    quick: bool = False
    """Every step at a reduced size (4 distillation steps, 8 documents per task, short probes and
    benchmark) for CI and a first look; the overrides above still apply after it."""

    out: str = "artifacts/main"
    """Output folder (the distillation's storage path is ``out/distill`` unless the recipe sets an
    ``s3://`` one)."""


class Steps:
    """Numbered, timed progress lines: ``[k/n] what``, and each step's seconds for the report."""

    def __init__(self, names: list[str]):
        self.names, self.seconds, self._t = names, {}, None

    def start(self, name: str, detail: str = "") -> None:
        self._close()
        self._current, self._t = name, time.monotonic()
        log.info("[%d/%d] %s%s", self.names.index(name) + 1, len(self.names), name, f": {detail}" if detail else "")

    def _close(self) -> None:
        if self._t is not None:
            self.seconds[self._current] = round(time.monotonic() - self._t, 1)
            self._t = None

    def done(self) -> dict[str, float]:
        self._close()
        return self.seconds


def simscore_step(model_path: str, cfg: MainConfig, out: Path) -> dict[str, Any]:
    from swiftkv.analysis.simscore import compute_simscore, save_result

    samples, max_len = (4, 128) if cfg.quick else (cfg.simscore_samples, cfg.simscore_max_len)
    result = compute_simscore(model_path, "bundled", samples, max_len, 4, 0.5)
    save_result(result, out / "simscore")
    return {"recommended_num_key_value_layers": result.recommended_num_key_value_layers,
            "targets": [t.__dict__ for t in result.targets], "tokens": result.num_tokens}


def hf_answers(checkpoint: str, prompts: list[str], max_new_tokens: int) -> dict[str, list[list[int]]]:
    from swiftkv.inference import chat_generate, load_chat_model

    model, tokenizer = load_chat_model(checkpoint)
    return {"teacher": chat_generate(model.swiftkv(False), tokenizer, prompts, max_new_tokens),
            "student": chat_generate(model.swiftkv(True), tokenizer, prompts, max_new_tokens)}


def short_rows(recipe: DistillConfig, max_seq_len: int) -> DistillConfig:
    """``recipe`` with rows of at most ``max_seq_len`` tokens, its retrieval chats made that short too."""
    from swiftkv.distill.config import RetrievalSourceConfig

    sources = [src.model_copy(update={"min_tokens": min(src.min_tokens, max_seq_len // 2), "max_tokens": max_seq_len})
               if isinstance(src, RetrievalSourceConfig) else src for src in recipe.data.sources]
    data = recipe.data.model_copy(update={"sources": sources, "max_seq_len": min(recipe.data.max_seq_len, max_seq_len)})
    return recipe.model_copy(update={"data": data})


def serve_step(models: dict[str, str], cfg: MainConfig, out: Path) -> dict[str, Any]:
    """``swiftkv serve`` both models; each answers the prompts through the ``openai`` client."""
    import openai

    from serve_apps.subprocess_server import ServeProcess

    # One replica each: the step shows the service, it does not load-test it.
    args = ["--config", cfg.serve_config]
    for i, (name, path) in enumerate(models.items()):
        args += ["--model", f"{name}={path}", "--set", f"models.{i}.autoscaling.max_replicas=1"]
    answers: dict[str, list[str]] = {}
    with ServeProcess(args, out / "serve.log") as server:
        log.info("swiftkv serve ready in %.0f s at %s", server.ready_s, server.base_url)
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
        served = sorted(m.id for m in client.models.list().data)
        for name in models:
            answers[name] = [
                client.chat.completions.create(model=name, messages=[{"role": "user", "content": p}], temperature=0.0,
                                               max_tokens=cfg.max_new_tokens).choices[0].message.content.strip()
                for p in cfg.prompts]
    return {"url": server.base_url, "ready_s": round(server.ready_s, 1), "models": served, "answers": answers,
            "exit_code": server.exit_code, "log": str(out / "serve.log")}


def run(cfg: MainConfig) -> dict[str, Any]:
    import ray
    from transformers import AutoConfig, AutoTokenizer

    from ray_jobs.bench_vllm import ServingBenchConfig
    from ray_jobs.benchmark import run as run_benchmark
    from ray_jobs.distill import run as run_distill
    from ray_jobs.evaluate import run as run_evaluate
    from swiftkv.convert import convert_checkpoint
    from swiftkv.distill.config import load_config as load_distill_config
    from swiftkv.distill.train_loop import MODEL_DIR
    from swiftkv.evaluation.config import EvalConfig
    from swiftkv.model_source import resolve_model
    from swiftkv.yaml_config import load_config

    out = Path(cfg.out).resolve()
    quick = QUICK if cfg.quick else FULL
    recipe = load_distill_config(cfg.distill, [f"output.storage_path={out / 'distill'}", *quick.get("distill", []),
                                               *cfg.distill_overrides])
    if cfg.quick:
        recipe = short_rows(recipe, QUICK_MAX_SEQ_LEN)
    # Checked before any work: a bad key in any of the three configs is an error now, not in an hour.
    # The config is checked against the models the job will name (the gate and the probes name them).
    job_models = {"base": recipe.model, "rewired": str(out / "rewired"), "distilled": str(out / "distill")}
    evaluation = load_config(EvalConfig, cfg.evaluate,
                             [f"models={json.dumps(job_models)}", *quick.get("evaluate", []), *cfg.evaluate_overrides],
                             "evaluation config")
    bench = load_config(ServingBenchConfig, cfg.benchmark, [*quick.get("benchmark", []), *cfg.benchmark_overrides],
                        "benchmark config")
    out.mkdir(parents=True, exist_ok=True)
    names = ["SimScore", "convert", "distil", "answers", "evaluate", "prefill benchmark", "serve", "report"]
    steps = Steps([n for n in names if cfg.serve or n != "serve"])
    base = resolve_model(recipe.model)
    num_layers = AutoConfig.from_pretrained(base).num_hidden_layers

    steps.start("SimScore", base)
    simscore = simscore_step(base, cfg, out)
    recommended = simscore["recommended_num_key_value_layers"]
    use_simscore = cfg.cutoff == "simscore" and recommended is not None
    c = recommended if use_simscore else recipe.num_key_value_layers
    source = "SimScore's recommendation" if use_simscore else "the recipe's num_key_value_layers"
    log.info("cutoff c = %d of %d layers (%s; SimScore recommends %s)", c, num_layers, source, recommended)

    steps.start("convert", f"{base} -> {out / 'rewired'} (c={c}, g={recipe.key_value_group_size})")
    rewired = out / "rewired"
    convert_checkpoint(base, rewired, num_key_value_layers=c, key_value_group_size=recipe.key_value_group_size,
                       overwrite=True)
    # The distillation starts from the base as the recipe says (its ``init``: the copy start is the
    # rewired model above; the least-squares start is fitted by the distillation job); ``rewired`` is
    # the paper's undistilled conversion, the floor of the recovered share.
    recipe = recipe.model_copy(update={"num_key_value_layers": c})

    steps.start("distil", f"{recipe.train.max_steps} steps on Ray Train ({cfg.distill})")
    if not ray.is_initialized():
        ray.init()
    result = run_distill(recipe)
    checkpoint = f"{result.checkpoint.path}/{MODEL_DIR}"
    metrics = {k: v for k, v in result.metrics.items() if k.startswith(("heldout", "step", "loss", "kl"))}
    metrics["steps"] = result.metrics.get("step")

    steps.start("answers", "teacher and student (prefill skipping) in Hugging Face")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = hf_answers(checkpoint, cfg.prompts, cfg.max_new_tokens)
    answers = {k: [tokenizer.decode(t, skip_special_tokens=True).strip() for t in v] for k, v in ids.items()}

    models = {"base": base, "rewired": str(rewired), "distilled": checkpoint}
    steps.start("evaluate", f"{', '.join(models)} on {', '.join(t.name for t in evaluation.tasks)} + probes")
    quality = run_evaluate(evaluation.model_copy(update={"models": models, "out": str(out / "eval")}))

    steps.start("prefill benchmark", "vLLM, base vs SwiftKV, side by side")
    # The benchmark takes the paper's "F SwiftKV": the share of layers the prompt skips.
    skipped = (num_layers - c) / num_layers
    bench = run_benchmark(bench.model_copy(update={"model": base, "cutoff": skipped, "out": str(out / "bench"),
                                                   "work_dir": str(out / "bench" / "models")}))

    report: dict[str, Any] = {
        "base_model": base, "num_layers": num_layers, "checkpoint": checkpoint, "quick": cfg.quick,
        "cutoff": {"num_key_value_layers": c, "source": source, "simscore_recommended": recommended},
        "key_value_group_size": recipe.key_value_group_size, "simscore": simscore, "distill": metrics,
        "quality": quality["quality"], "long_context": quality["long_context"], "multi_turn": quality["multi_turn"],
        "gate": quality.get("gate"),
        "prefill_benchmark": {"throughput_tok_s": bench["throughput_tok_s"], "latency": bench["latency"],
                              "kv_capacity": bench["kv_capacity"]},
        "prompts": cfg.prompts, "answers": answers,
    }
    if cfg.serve:
        steps.start("serve", "swiftkv serve base + distilled, asked through the openai client")
        ray.shutdown()  # the service starts its own local Ray
        served = serve_step({"base": base, "swiftkv": checkpoint}, cfg, out)
        answers["served base"], answers["served swiftkv"] = served["answers"]["base"], served["answers"]["swiftkv"]
        same = sum(a == b for a, b in zip(answers["served swiftkv"], answers["student"], strict=True))
        report["serve"] = {k: v for k, v in served.items() if k != "answers"}
        report["serve"]["swiftkv_matches_hf_student"] = f"{same}/{len(cfg.prompts)} prompts"
    steps.start("report")
    report["seconds"] = steps.done()
    path = write_report(report, quality, out)
    print(path.read_text())
    return report


def main(argv: list[str] | None = None) -> int:
    return job_main("python -m ray_jobs.main", __doc__.split("\n\n")[0], MainConfig, run, argv,
                    what="main job config", config_help="YAML config (default: the embedded SmolLM2 CPU default)")


if __name__ == "__main__":
    sys.exit(main())
