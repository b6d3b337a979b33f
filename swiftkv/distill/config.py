"""The typed distillation config: one YAML file, validated before anything starts.

Unknown or misspelt keys are errors that name the key (``extra="forbid"`` everywhere), and every
default is the paper's recipe (SPEC.md) unless the field's docstring says otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from swiftkv import yaml_config
from swiftkv.config import TokenShift
from swiftkv.yaml_config import StrictConfig

SourceFormat = Literal["ultrachat", "openhermes", "slimorca", "messages", "chitchat"]
RetrievalTask = Literal["passkey", "kv_lookup", "recall", "doc_qa"]
MIN_RETRIEVAL_TOKENS = 192  # the templates and the question take up to about 120 tokens


class SourceConfig(StrictConfig):
    uri: str
    """Where the rows are: a local path, a glob, ``s3://bucket/prefix/*.parquet`` or any fsspec URI
    (``hf://datasets/...`` for hub parquet). Files are ``.parquet``, ``.jsonl`` or (chitchat) ``.json``."""

    format: SourceFormat
    """The row schema: ``ultrachat``/``messages`` (a ``messages`` list of role/content),
    ``openhermes``/``slimorca`` (a ``conversations`` list of from/value with system/human/gpt),
    ``chitchat`` (the chitchat-dataset conversation objects)."""

    sample_count: int | None = Field(default=None, gt=0)
    """Take at most this many rows from the source (in file order). Exclusive with ``weight``."""

    weight: float | None = Field(default=None, gt=0, le=1)
    """Keep this random fraction of the source's rows (seeded). Exclusive with ``sample_count``;
    when neither is given every row is used once."""

    @model_validator(mode="after")
    def _one_way_to_size(self) -> SourceConfig:
        if self.sample_count is not None and self.weight is not None:
            raise ValueError(f"source {self.uri!r}: give sample_count or weight, not both")
        return self


class RetrievalSourceConfig(StrictConfig):
    """Synthetic retrieval chats, made as the pipeline streams (``swiftkv/distill/retrieval_data.py``):
    answers copied from far back in the prompt, which chat data rarely asks for."""

    synthetic: Literal["retrieval"]
    """Marks the source as generated (no file is read but the filler)."""

    tasks: list[RetrievalTask] = Field(default=["passkey", "kv_lookup", "recall", "doc_qa"], min_length=1)
    """Kinds of rows, in turn: ``passkey`` (a code hidden in filler text), ``kv_lookup`` (one record of a
    long list), ``recall`` (a fact from the first turn, after many turns), ``doc_qa`` (a SQuAD question over
    filler paragraphs holding its paragraph)."""

    rows: int = Field(default=2000, gt=0)
    """Rows generated (row i is a function of ``seed`` and i alone)."""

    min_tokens: int = Field(default=512, ge=MIN_RETRIEVAL_TOKENS)
    """Shortest row, in tokens through the model's chat template."""

    max_tokens: int = Field(default=2048, gt=0)
    """Longest row; each row's length is drawn log-uniformly between the two."""

    filler: str = "bundled:squad"
    """The text the answers hide in: ``bundled:squad`` (SQuAD v2 dev paragraphs and questions, CC BY-SA 4.0),
    ``bundled:essays`` (the Paul Graham essays; the evaluation's needle filler: avoid for training) or a local
    ``.txt`` file (paragraphs split on blank lines; ``recall``/``doc_qa`` need ``bundled:squad``)."""

    seed: int = 0
    """Seed of the rows' contents."""

    @model_validator(mode="after")
    def _lengths_in_order(self) -> RetrievalSourceConfig:
        if self.max_tokens < self.min_tokens:
            raise ValueError(f"retrieval source: max_tokens {self.max_tokens} < min_tokens {self.min_tokens}")
        return self


def _source_kind(value: Any) -> str:
    """A source with a ``synthetic`` key is generated; any other names files."""
    if isinstance(value, dict):
        return "retrieval" if "synthetic" in value else "file"
    return "retrieval" if isinstance(value, RetrievalSourceConfig) else "file"


AnySource = Annotated[Annotated[SourceConfig, Tag("file")] | Annotated[RetrievalSourceConfig, Tag("retrieval")],
                      Discriminator(_source_kind)]


class DataConfig(StrictConfig):
    sources: list[AnySource] = Field(min_length=1)
    """The sources to mix: chat files (the paper: UltraChat-200k, OpenHermes-2.5 and SlimOrca; ``uri`` and
    ``format``) and synthetic retrieval chats (``synthetic: retrieval``)."""

    max_seq_len: int = Field(default=8192, gt=8)
    """Tokens per training row; longer examples are truncated (and counted in the log)."""

    pack: bool = True
    """Pack several examples into each row; attention stays inside each example."""

    loss_on: Literal["assistant", "all"] = "assistant"
    """Which positions the KL is averaged over: those predicting assistant tokens, or every token."""

    heldout_fraction: float = Field(default=0.01, ge=0, lt=1)
    """Fraction of examples (chosen by a hash of their text, so stable across runs) kept out of
    training and used for the held-out KL / top-1 agreement. A synthetic source holds out this share
    of its ``rows`` (at least one) as extra rows of its own, generated after the training ones."""

    heldout_max_rows: int = Field(default=64, gt=0)
    """At most this many held-out rows are evaluated (bounds the evaluation time)."""

    pack_window: int = Field(default=256, gt=0)
    """Examples handed to the packer at once; a bigger window packs tighter. Each window mixes the
    sources (an equal share of each, in turn)."""

    shuffle_buffer_rows: int = Field(default=16, ge=0)
    """Packed rows each worker keeps in a local shuffle buffer and draws from at random (seeded by
    ``seed`` and the epoch), on top of the seeded file order; 0 = off. A worker waits for this many
    rows before its first batch. The pipeline itself keeps a fixed order, so a resumed run sees
    exactly the rows of an uninterrupted one."""

    seed: int = 0
    """Seed for the file order, source sampling and the workers' shuffle buffers."""

    @model_validator(mode="after")
    def _retrieval_rows_fit(self) -> DataConfig:
        for src in self.sources:
            if isinstance(src, RetrievalSourceConfig) and src.max_tokens > self.max_seq_len:
                raise ValueError(f"a retrieval source asks for {src.max_tokens}-token rows, over max_seq_len "
                                 f"{self.max_seq_len} (the answer, at the end, would be cut off)")
        return self


class TrainConfig(StrictConfig):
    micro_batch_size: int = Field(default=1, gt=0)
    """Rows per worker per forward pass."""

    grad_accum: int = Field(default=1, gt=0)
    """Micro-batches accumulated per optimizer step."""

    epochs: int = Field(default=2, gt=0)
    """Passes over the data (the paper: 2). Ignored when ``max_steps`` is set."""

    max_steps: int | None = Field(default=None, gt=0)
    """Stop after this many optimizer steps. The pipeline then reads only the rows these steps train
    on (the data is re-read as often as needed when it is shorter)."""

    lr: float = Field(default=3e-4, gt=0)
    """AdamW peak learning rate."""

    weight_decay: float = Field(default=0.05, ge=0)
    """AdamW weight decay."""

    warmup_ratio: float = Field(default=0.05, ge=0, lt=1)
    """Linear warm-up share of the steps, then cosine decay to zero."""

    temperature: float = Field(default=2.0, gt=0)
    """Distillation temperature tau; the KL is scaled by tau^2."""

    loss_normalization: Literal["tokens", "reference"] = "tokens"
    """``tokens``: the KL is averaged over every selected token of the optimizer step, across its
    micro-batches and workers (each token weighs the same). ``reference``: as the reference SwiftKV
    trainer does, each micro-batch's KL sum is divided by all its positions (selected or not, padding
    included), then averaged over micro-batches and workers (docs/distillation.md compares them)."""

    reuse_teacher_prefix: bool = True
    """Run the frozen layers ``0..c-1`` once for teacher and student (they see the same input), and
    start the student from the teacher's state at the cutoff: same loss and gradients, without the
    student's forward through those layers (at 50% SwiftKV, half its forward). ``false`` runs both
    models whole."""

    hidden_loss_weight: float = Field(default=0.0, ge=0)
    """Weight of the MSE between student and teacher second-to-last hidden states (0 = the paper's KL alone)."""

    loss_chunk_tokens: int = Field(default=1024, gt=0)
    """Tokens per KL chunk: full-vocabulary logits exist for this many tokens at a time."""

    gradient_checkpointing: bool = False
    """Recompute the student's layer activations in backward (needed for 8K rows on big models)."""

    eval_every_steps: int | None = Field(default=None, gt=0)
    """Also measure the held-out KL every N steps (it is always measured before and after)."""

    seed: int = 0
    """Seed for anything random in the workers."""


class ScalingConfig(StrictConfig):
    num_workers: int = Field(default=1, gt=0)
    """Ray Train workers (one per GPU)."""

    use_gpu: bool = False
    """One GPU per worker, NCCL and bf16; otherwise gloo and float32 on CPU."""

    cpus_per_worker: float = Field(default=1.0, gt=0)
    """Logical CPUs each worker reserves (leave some for Ray Data's read tasks)."""

    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How Ray places the workers' bundles (Ray Train's placement group strategy): ``PACK`` fills a
    node before using the next (8 workers on an 8-GPU node); ``STRICT_SPREAD`` puts every worker on
    its own node (one worker per node)."""


class InitConfig(StrictConfig):
    """Where the SwiftKV weights start."""

    method: Literal["copy", "least_squares"] = "copy"
    """``copy``: SPEC.md's (each layer's own query projection; a group's mean key/value projections).
    ``least_squares``: the key/value projections fitted to the teacher's K/V on calibration rows
    (``swiftkv/least_squares_init.py``: one teacher pass, no backprop), the queries copied; not for
    DeepSeek-V2. A model that is already a SwiftKV checkpoint is trained as it is, whatever this says."""

    calibration_rows: int = Field(default=32, ge=5)
    """Training rows (the pipeline's first) the least-squares fit reads; every fifth is held out and
    scores the fit (R², logged and saved as ``init_fit.json`` beside the start)."""


class TokenShiftConfig(StrictConfig):
    """The token shift, a SwiftKV variant (docs/distillation.md, "Token shift"); off by default.
    Not served by the vLLM plugin yet: a checkpoint with it runs in Hugging Face transformers."""

    layers: list[int] = []
    """Layers after the cutoff whose SwiftKV K/V also read the cutoff state of the tokens before
    (e.g. ``[17, 18]`` on SmolLM2-135M at c = 15, where a previous-token head sits after the cutoff)."""

    tokens: int = Field(default=0, ge=0)
    """How many tokens before each token they read (0 = off; 1 or 2)."""

    def as_shift(self) -> TokenShift:
        return TokenShift(tuple(self.layers), self.tokens)


class DeepSpeedConfig(StrictConfig):
    zero_stage: Literal[2, 3] = 2
    """ZeRO stage: 2 shards gradients and optimizer state, 3 also the parameters."""


class OutputConfig(StrictConfig):
    storage_path: str
    """Local folder or ``s3://`` prefix for checkpoints and results; rerunning with the same path and
    ``name`` resumes from its latest checkpoint."""

    name: str = "swiftkv-distill"
    """Run name (a folder under ``storage_path``)."""

    checkpoint_every_steps: int = Field(default=500, gt=0)
    """Write a checkpoint every N optimizer steps (and always at the end)."""

    num_to_keep: int = Field(default=2, gt=0)
    """Checkpoints kept in storage (the oldest are deleted)."""

    max_failures: int = Field(default=3, ge=-1)
    """Worker-group restarts allowed (from the latest checkpoint); -1 = unlimited."""


class DistillConfig(StrictConfig):
    model: str
    """Base checkpoint: a local folder, a hub id, an ``s3://`` folder, or ``bundled`` (SmolLM2-135M-Instruct).
    A SwiftKV checkpoint is used as it is; any other is converted with the SPEC initialisation."""

    num_key_value_layers: int | None = None
    """The cutoff c (layers keeping their own KV); ``None`` = half the layers (50% SwiftKV)."""

    key_value_group_size: int = Field(default=1, gt=0)
    """AcrossKV group size (1 = off)."""

    token_shift: TokenShiftConfig = TokenShiftConfig()
    init: InitConfig = InitConfig()
    data: DataConfig
    train: TrainConfig = TrainConfig()
    scaling: ScalingConfig = ScalingConfig()
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    output: OutputConfig


def parse_config(tree: dict[str, Any], overrides: list[str] = ()) -> DistillConfig:
    """Validate a config tree after applying ``key.path=value`` overrides (values parsed as YAML)."""
    return yaml_config.parse_config(DistillConfig, tree, overrides, what="distillation config")


def load_config(path: str | Path, overrides: list[str] = ()) -> DistillConfig:
    """Read a YAML recipe, apply ``--set`` overrides and validate it."""
    return yaml_config.load_config(DistillConfig, path, overrides, what="distillation config")
