"""The body each Ray Train worker runs: DeepSpeed ZeRO over the teacher/student objective.

Checkpoint folder (one per save, written by every worker into the same Ray checkpoint; Ray Train
registers it only once every worker has uploaded its part, so a crash mid-save never leaves a
half-written checkpoint as the latest):
- ``deepspeed/``: the trainable weights, optimizer and scheduler state of every rank, and the
  progress (step, epoch, micro-batches consumed, the data and optimizer digests), for resuming.
  Frozen weights are not repeated there: they come from the starting model again on resume.
- ``swiftkv/``: the SwiftKV tensors, the student's config and a pointer to the starting model
  whose other weights they complete (rank 0): all a checkpoint changes, a few percent of the
  model. ``swiftkv merge`` turns it into a full checkpoint on request.
- ``model/`` (the last checkpoint only): the full SPEC checkpoint, the starting model's shards
  copied beside the SwiftKV shard, ready for ``from_pretrained`` and vLLM, with its model card
  (``README.md``: the recipe and the held-out figures; ``swiftkv.model_card``).
- ``heldout_curve.json``: every held-out KL / top-1 measurement so far (rank 0).

Exact resume: the data arrive in a fixed order (``data.py``; the trainer preserves it), each worker
shuffles them in a buffer seeded by the epoch, and the progress records how many micro-batches of
the epoch were consumed, so a restarted worker skips exactly those. A running digest of every batch
each worker trained on and a digest of the optimizer state travel with the checkpoint; the restored
optimizer state and learning rate are checked against it, and the data digest is reported with
every metric, so two runs can be compared for the very same data.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import deepspeed
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from transformers import get_cosine_schedule_with_warmup

from swiftkv.checkpoint_files import write_checkpoint
from swiftkv.distill.config import DistillConfig
from swiftkv.distill.data import load_tokenizer
from swiftkv.distill.evaluate import heldout_metrics
from swiftkv.distill.model_io import load_student, write_swiftkv_part
from swiftkv.distill.objective import DistillationObjective, freeze_all_but_swiftkv
from swiftkv.model_card import write_card
from swiftkv.model_source import resolve_model

DEEPSPEED_DIR = "deepspeed"
SWIFTKV_DIR = "swiftkv"
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
    data_digests: list[str] = field(default_factory=list)
    """Per rank, the head of a SHA-256 chain over every micro-batch that rank trained on."""
    optimizer_digests: list[list[float]] = field(default_factory=list)
    """Per rank, the sums of its optimizer state tensors when the checkpoint was written."""
    lr: float = 0.0
    """The learning rate when the checkpoint was written."""
    at_start: dict[str, float] = field(default_factory=dict)
    """Held-out metrics before any training (``heldout_kl_at_start``...), repeated in every report."""
    curve: list[dict[str, float]] = field(default_factory=list)
    """Every held-out measurement so far (the recovery curve), written into each checkpoint."""


def deepspeed_config(cfg: DistillConfig) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": cfg.train.grad_accum,
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage},
        "bf16": {"enabled": cfg.scaling.use_gpu},
        # A plain torch AdamW: no compiled DeepSpeed op is needed, on CPU or GPU.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }


def optimizer_digest(engine) -> list[float]:
    """Sums of this rank's optimizer state (its master weights and moments) in a fixed order: what
    a checkpoint must give back exactly."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch optimizer ZeRO wraps
    sums = []
    for group in inner.param_groups:
        for param in group["params"]:
            sums.append(float(param.detach().double().sum()))
            for _, value in sorted(inner.state.get(param, {}).items()):
                sums.append(float(value.double().sum()) if torch.is_tensor(value) else float(value))
    return sums


def _all_gather(value: Any) -> list[Any]:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


class Worker:
    """One worker's training state; ``run`` is the loop (``train_loop_per_worker`` builds it in a
    Ray Train worker; it needs only a torch process group)."""

    def __init__(self, cfg: DistillConfig, total_steps: int, rank: int, world_size: int, device: torch.device,
                 recipe: dict[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.recipe = recipe or cfg.model_dump()  # as the user gave it, for the model card
        self.total_steps = total_steps
        self.rank, self.world_size, self.device = rank, world_size, device
        torch.manual_seed(cfg.train.seed)
        self.start = resolve_model(cfg.model)
        self.tokenizer = load_tokenizer(self.start)
        dtype = torch.bfloat16 if cfg.scaling.use_gpu else torch.float32
        ds_config = deepspeed_config(cfg)
        self.model = load_student(self.start, cfg.num_key_value_layers, cfg.key_value_group_size, dtype, ds_config,
                                  cfg.token_shift.as_shift())
        if cfg.train.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        trainable = freeze_all_but_swiftkv(self.model)
        self.objective = DistillationObjective(
            self.model, cfg.train.temperature, cfg.train.hidden_loss_weight, cfg.train.loss_chunk_tokens,
            cfg.train.loss_normalization, cfg.train.reuse_teacher_prefix,
        )
        optimizer = torch.optim.AdamW(trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        warmup = math.ceil(cfg.train.warmup_ratio * total_steps)
        scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.objective, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        self.objective.gather_head_per_forward()
        # from_pretrained returns the model in eval mode, where transformers skips gradient
        # checkpointing: train in training mode (heldout() switches to eval and back).
        self.engine.train()
        self.progress = Progress()
        # A hash chain over the micro-batches (each link hashes the previous digest and the batch), so
        # a resumed worker continues it from the checkpoint's value; a hash object's state cannot be.
        self.data_digest = ""
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
        # Fail loudly rather than train on from a state that is not the checkpoint's.
        restored = optimizer_digest(self.engine)
        if restored != self.progress.optimizer_digests[self.rank] or self.engine.get_lr()[0] != self.progress.lr:
            raise RuntimeError(f"rank {self.rank}: the restored optimizer state or learning rate differs from "
                               f"checkpoint {checkpoint.path}")
        self.data_digest = self.progress.data_digests[self.rank]
        self.resumed_from_step = self.progress.step
        self.log(f"resumed from {checkpoint.path} at step {self.progress.step} (epoch {self.progress.epoch}, "
                 f"{self.progress.batches_in_epoch} micro-batches in); optimizer state and lr {self.progress.lr:.3e} "
                 "verified against the checkpoint")

    def heldout(self) -> dict[str, float]:
        shard = ray.train.get_dataset_shard("heldout") if self.cfg.data.heldout_fraction > 0 else None
        if shard is None:
            return {}
        self.engine.eval()
        batches = shard.iter_torch_batches(batch_size=self.cfg.train.micro_batch_size, dtypes=torch.long,
                                           device=self.device)
        metrics = heldout_metrics(self.objective, batches)
        self.engine.train()
        self.progress.curve.append({"step": self.progress.step, **metrics})
        self.log(
            f"held-out at step {self.progress.step}: KL {metrics['heldout_kl']:.4f}, "
            f"top-1 agreement {metrics['heldout_top1']:.3f} over {metrics['heldout_tokens']} tokens"
        )
        return metrics

    def _swiftkv_tensors(self) -> dict[str, torch.Tensor] | None:
        """The SwiftKV weights, whole, on rank 0 (a collective under ZeRO-3, which shards them)."""
        named = self.model.swiftkv_parameters()
        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return {name: p.detach().cpu().clone() for name, p in named} if self.rank == 0 else None

    def save(self, metrics: dict[str, Any], final: bool) -> None:
        self.progress.data_digests = _all_gather(self.data_digest)
        self.progress.optimizer_digests = _all_gather(optimizer_digest(self.engine))
        self.progress.lr = self.engine.get_lr()[0]
        with tempfile.TemporaryDirectory() as tmp:
            self.engine.save_checkpoint(
                str(Path(tmp) / DEEPSPEED_DIR),
                tag=_TAG,
                client_state={"progress": asdict(self.progress)},
                exclude_frozen_parameters=True,
            )
            tensors = self._swiftkv_tensors()
            if self.rank == 0:
                self.model.swiftkv(True)
                write_swiftkv_part(self.model.config, tensors, self.cfg.model, Path(tmp) / SWIFTKV_DIR)
                if final:
                    write_checkpoint(self.start, tensors, self.model.config, Path(tmp) / MODEL_DIR)
                    write_card(Path(tmp) / MODEL_DIR, self.model.config, self.recipe, metrics)
                (Path(tmp) / CURVE_FILE).write_text(json.dumps(self.progress.curve, indent=1))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                             checkpoint_dir_name=f"step_{self.progress.step:08d}")
        self.log(f"checkpoint at step {self.progress.step}" + (" (with the full model)" if final else ""))

    def report(self, metrics: dict[str, float], save: bool = False, final: bool = False) -> None:
        """Report metrics (a barrier across workers), with a checkpoint when ``save``."""
        digest = hashlib.sha256("".join(_all_gather(self.data_digest)).encode()).hexdigest()[:16]
        metrics = {"step": self.progress.step, "resumed_from_step": self.resumed_from_step, "data_digest": digest,
                   **self.progress.at_start, **metrics}
        if save:
            self.save(metrics, final)
        else:
            ray.train.report(metrics)

    def _epoch_batches(self, shard):
        """This worker's micro-batches of the current epoch, on the CPU: the fixed stream through a
        shuffle buffer seeded by the epoch, the ones consumed before a restart skipped."""
        cfg = self.cfg
        buffer = cfg.data.shuffle_buffer_rows or None
        seed = cfg.data.seed + self.progress.epoch if buffer else None
        batches = shard.iter_torch_batches(
            batch_size=cfg.train.micro_batch_size, drop_last=True, dtypes=torch.long, device="cpu",
            local_shuffle_buffer_size=buffer, local_shuffle_seed=seed,
        )
        return islice(batches, self.progress.batches_in_epoch, None)

    def _step(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, float, int]:
        """One optimizer step over ``micro_batches``; returns the step's (loss, KL per token, tokens)
        over every worker."""
        world = self.world_size
        totals = torch.tensor([sum(int(b["loss_mask"].sum()) for b in micro_batches)], dtype=torch.float64)
        dist.all_reduce(totals)  # the selected tokens of the whole step, every worker's
        token_scale = world * len(micro_batches) / max(float(totals[0]), 1.0)
        sums = torch.zeros(2, dtype=torch.float64)  # loss, KL
        for batch in micro_batches:
            parts = self.engine(**{k: v.to(self.device) for k, v in batch.items()}, token_scale=token_scale)
            self.engine.backward(parts.loss)
            self.engine.step()
            sums += torch.tensor([float(parts.loss.detach()), float(parts.kl_sum)], dtype=torch.float64)
        dist.all_reduce(sums)
        tokens = int(totals[0])
        return float(sums[0]) / (world * len(micro_batches)), float(sums[1]) / max(tokens, 1), tokens

    def run(self) -> None:
        cfg, progress = self.cfg, self.progress
        if progress.step == 0:
            progress.at_start = {f"{k}_at_start": v for k, v in self.heldout().items()}
            self.report({})
        shard = ray.train.get_dataset_shard("train")
        started = window_start = time.perf_counter()
        window_tokens = 0
        while progress.step < self.total_steps:
            batches = self._epoch_batches(shard)
            while progress.step < self.total_steps:
                micro_batches = list(islice(batches, cfg.train.grad_accum))
                if len(micro_batches) < cfg.train.grad_accum:
                    break  # the epoch's rows are used up (a partial step is dropped)
                for batch in micro_batches:
                    link = bytes.fromhex(self.data_digest) + batch["input_ids"].numpy().tobytes()
                    self.data_digest = hashlib.sha256(link).hexdigest()
                loss, kl, _ = self._step(micro_batches)
                progress.step += 1
                progress.batches_in_epoch += len(micro_batches)
                window_tokens += len(micro_batches) * batch["input_ids"].numel() * self.world_size
                now = time.perf_counter()
                metrics = {"loss": loss, "kl": kl, "lr": self.engine.get_lr()[0], "epoch": progress.epoch,
                           "tokens_per_s": window_tokens / (now - window_start),
                           "grad_norm": float(self.engine.get_global_grad_norm() or 0.0)}
                eta = (now - started) / max(progress.step - max(self.resumed_from_step, 0), 1) * (
                    self.total_steps - progress.step)
                self.log(f"step {progress.step}/{self.total_steps} loss {loss:.4f} kl {kl:.4f} lr {metrics['lr']:.2e} "
                         f"tok/s {metrics['tokens_per_s']:.0f} grad_norm {metrics['grad_norm']:.3f} eta {eta:.0f}s")
                window_start, window_tokens = now, 0
                last = progress.step >= self.total_steps
                if last or (cfg.train.eval_every_steps and progress.step % cfg.train.eval_every_steps == 0):
                    metrics.update(self.heldout())
                save = last or progress.step % cfg.output.checkpoint_every_steps == 0
                self.report(metrics, save=save, final=last)
            if progress.step >= self.total_steps:
                break
            if progress.batches_in_epoch == 0:
                raise RuntimeError("this worker got no training rows: add data or lower num_workers")
            progress.epoch += 1
            progress.batches_in_epoch = 0


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Ray Train entry point: ``{"config": DistillConfig dump, "total_steps": int, "recipe": the config
    as the user gave it}``."""
    ctx = ray.train.get_context()
    worker = Worker(DistillConfig.model_validate(loop_config["config"]), loop_config["total_steps"],
                    ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device(), loop_config.get("recipe"))
    worker.restore()
    worker.run()
