"""The body each Ray Train worker runs: DeepSpeed ZeRO over the teacher/student objective.

Checkpoint folder (one per save, written by every worker into the same Ray checkpoint):
- ``model/``: the student in the SPEC checkpoint layout (rank 0), ready for ``from_pretrained``;
- ``heldout_curve.json``: every held-out KL / top-1 measurement so far (rank 0);
- ``deepspeed/``: the trainable weights, optimizer and scheduler state of every rank, and the
  progress (step, epoch, micro-batches consumed), for resuming. Frozen weights are not repeated
  there: they come from ``model`` again on resume.
Ray Train registers a checkpoint only once every worker has uploaded its part, so a crash mid-save
never leaves a half-written checkpoint as the latest.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import deepspeed
import ray.train
import ray.train.torch
import torch
from transformers import get_cosine_schedule_with_warmup

from swiftkv.distill.config import DistillConfig
from swiftkv.distill.data import load_tokenizer
from swiftkv.distill.evaluate import heldout_metrics
from swiftkv.distill.model_io import load_student, write_hf_checkpoint
from swiftkv.distill.objective import DistillationObjective, freeze_all_but_swiftkv
from swiftkv.model_source import resolve_model

DEEPSPEED_DIR = "deepspeed"
MODEL_DIR = "model"
CURVE_FILE = "heldout_curve.json"
_TAG = "state"


@dataclass
class Progress:
    step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """Current pass over the data."""
    batches_in_epoch: int = 0
    """Micro-batches of the current epoch already trained on (skipped on resume)."""
    at_start: dict[str, float] = field(default_factory=dict)
    """Held-out metrics before any training (``heldout_kl_at_start``...), repeated in every report."""
    curve: list[dict[str, float]] = field(default_factory=list)
    """Every held-out measurement so far (the recovery curve), written into each checkpoint."""


def deepspeed_config(cfg: DistillConfig) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": cfg.train.grad_accum,
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage, "stage3_gather_16bit_weights_on_model_save": True},
        "bf16": {"enabled": cfg.scaling.use_gpu},
        # A plain torch AdamW: no compiled DeepSpeed op is needed, on CPU or GPU.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }


def _full_state_dict(engine, stage: int, rank: int) -> dict[str, torch.Tensor] | None:
    """The whole student's weights on rank 0 (a collective under ZeRO-3, which shards them)."""
    if stage == 3:
        state = engine._zero3_consolidated_16bit_state_dict()
    else:
        state = engine.module.state_dict() if rank == 0 else None
    if state is None:
        return None
    return {name.removeprefix("model."): tensor for name, tensor in state.items()}


class Worker:
    """One worker's training state; ``run`` is the loop."""

    def __init__(self, cfg: DistillConfig, total_steps: int) -> None:
        self.cfg = cfg
        self.total_steps = total_steps
        self.ctx = ray.train.get_context()
        self.rank = self.ctx.get_world_rank()
        self.device = ray.train.torch.get_device()
        torch.manual_seed(cfg.train.seed)
        path = resolve_model(cfg.model)
        self.tokenizer = load_tokenizer(path)
        dtype = torch.bfloat16 if cfg.scaling.use_gpu else torch.float32
        ds_config = deepspeed_config(cfg)
        self.model = load_student(path, cfg.num_key_value_layers, cfg.key_value_group_size, dtype, ds_config)
        if cfg.train.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        trainable = freeze_all_but_swiftkv(self.model)
        objective = DistillationObjective(
            self.model, cfg.train.temperature, cfg.train.hidden_loss_weight, cfg.train.loss_chunk_tokens
        )
        optimizer = torch.optim.AdamW(trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        warmup = math.ceil(cfg.train.warmup_ratio * total_steps)
        scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)
        self.engine, _, _, _ = deepspeed.initialize(
            model=objective, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        self.progress = Progress()
        self.resumed_from_step = -1  # reported with every metric: -1 = a fresh start

    def log(self, text: str) -> None:
        if self.rank == 0:
            print(f"[swiftkv distill] {text}", flush=True)

    def restore(self) -> None:
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return
        with checkpoint.as_directory() as folder:
            _, client = self.engine.load_checkpoint(
                str(Path(folder) / DEEPSPEED_DIR), tag=_TAG, load_module_strict=False
            )
        self.progress = Progress(**client["progress"])
        self.resumed_from_step = self.progress.step
        self.log(f"resumed from {checkpoint.path} at step {self.progress.step}")

    def heldout(self) -> dict[str, float]:
        shard = ray.train.get_dataset_shard("heldout") if self.cfg.data.heldout_fraction > 0 else None
        if shard is None:
            return {}
        batches = shard.iter_torch_batches(batch_size=self.cfg.train.micro_batch_size, device=self.device)
        metrics = heldout_metrics(self.engine.module, batches)
        self.progress.curve.append({"step": self.progress.step, **metrics})
        self.log(
            f"held-out at step {self.progress.step}: KL {metrics['heldout_kl']:.4f}, "
            f"top-1 agreement {metrics['heldout_top1']:.3f} over {metrics['heldout_tokens']} tokens"
        )
        return metrics

    def report(self, metrics: dict[str, float], save: bool) -> None:
        """Report metrics (a barrier across workers), with a checkpoint when ``save``."""
        metrics = {
            "step": self.progress.step,
            "resumed_from_step": self.resumed_from_step,
            **self.progress.at_start,
            **metrics,
        }
        if not save:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory() as tmp:
            self.engine.save_checkpoint(
                str(Path(tmp) / DEEPSPEED_DIR),
                tag=_TAG,
                client_state={"progress": asdict(self.progress)},
                exclude_frozen_parameters=True,
            )
            state = _full_state_dict(self.engine, self.cfg.deepspeed.zero_stage, self.rank)
            if self.rank == 0:
                write_hf_checkpoint(self.model, state, self.tokenizer, Path(tmp) / MODEL_DIR)
                (Path(tmp) / CURVE_FILE).write_text(json.dumps(self.progress.curve, indent=1))
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(tmp),
                checkpoint_dir_name=f"step_{self.progress.step:08d}",
            )
        self.log(f"checkpoint at step {self.progress.step}")

    def run(self) -> None:
        cfg, progress = self.cfg, self.progress
        if progress.step == 0:
            progress.at_start = {f"{k}_at_start": v for k, v in self.heldout().items()}
            self.report({}, save=False)
        shard = ray.train.get_dataset_shard("train")
        row_tokens = cfg.train.micro_batch_size * cfg.data.max_seq_len * self.ctx.get_world_size()
        window_start, window_loss, window_kl, window_batches = time.perf_counter(), 0.0, 0.0, 0
        started = time.perf_counter()
        while progress.step < self.total_steps:
            seen = 0
            for batch in shard.iter_torch_batches(
                batch_size=cfg.train.micro_batch_size, drop_last=True, dtypes=torch.long, device=self.device
            ):
                seen += 1
                if seen <= progress.batches_in_epoch:  # consumed before the restart
                    continue
                parts = self.engine(**batch)
                self.engine.backward(parts.loss)
                boundary = self.engine.is_gradient_accumulation_boundary()
                self.engine.step()
                window_loss += float(parts.loss)
                window_kl += float(parts.kl)
                window_batches += 1
                if not boundary:
                    continue
                progress.step += 1
                progress.batches_in_epoch = seen
                now = time.perf_counter()
                # Averaged over the workers, not rank 0's alone.
                window = torch.tensor([window_loss, window_kl], dtype=torch.float64, device=self.device)
                torch.distributed.all_reduce(window)
                loss, kl = (window / (window_batches * self.ctx.get_world_size())).tolist()
                metrics = {
                    "loss": loss,
                    "kl": kl,
                    "lr": self.engine.get_lr()[0],
                    "tokens_per_s": row_tokens * window_batches / (now - window_start),
                    "grad_norm": float(self.engine.get_global_grad_norm() or 0.0),
                    "epoch": progress.epoch,
                }
                eta = (now - started) / max(progress.step, 1) * (self.total_steps - progress.step)
                self.log(
                    f"step {progress.step}/{self.total_steps} loss {metrics['loss']:.4f} kl {metrics['kl']:.4f} "
                    f"lr {metrics['lr']:.2e} tok/s {metrics['tokens_per_s']:.0f} "
                    f"grad_norm {metrics['grad_norm']:.3f} eta {eta:.0f}s"
                )
                window_start, window_loss, window_kl, window_batches = now, 0.0, 0.0, 0
                last = progress.step >= self.total_steps
                every = cfg.train.eval_every_steps
                if last or (every and progress.step % every == 0):
                    metrics.update(self.heldout())
                self.report(metrics, save=last or progress.step % cfg.output.checkpoint_every_steps == 0)
                if last:
                    break
            else:
                if seen == 0:
                    raise RuntimeError("this worker got no training rows: add data or lower num_workers")
                progress.epoch += 1
                progress.batches_in_epoch = 0


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Ray Train entry point: ``{"config": DistillConfig dump, "total_steps": int}``."""
    worker = Worker(DistillConfig.model_validate(loop_config["config"]), loop_config["total_steps"])
    worker.restore()
    worker.run()
