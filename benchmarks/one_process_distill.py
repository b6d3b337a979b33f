"""The recipe's distillation in one process, for the benchmarks that train something the distillation
job does not (a shortened model, layers below the cutoff): the recipe's rows from its own Ray Data
pipeline, read in order on the driver, its KL (temperature, selected positions:
``swiftkv.distill.loss.chunked_kl_sum``), AdamW and its cosine learning-rate schedule. No DeepSpeed:
a 135M model needs none."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from itertools import islice

import torch
from torch import nn
from transformers import get_cosine_schedule_with_warmup

from swiftkv.distill.config import DistillConfig
from swiftkv.distill.loss import chunked_kl_sum
from swiftkv.model_source import resolve_model


def distill_in_one_process(recipe: DistillConfig, teacher: nn.Module, student: nn.Module,
                           param_groups: list[dict], label: str,
                           extra_loss: Callable[[], torch.Tensor] | None = None) -> list[dict]:
    """Train ``param_groups`` (AdamW groups; a group without ``lr`` takes the recipe's) of ``student``
    on the KL to ``teacher`` for the recipe's ``train.max_steps``; ``extra_loss`` (read after each
    student forward) is added to the loss. Returns the curve: per step the KL per selected token
    and the extra loss."""
    import ray

    from ray_jobs.distill import rows_per_step
    from swiftkv.distill.data import build_datasets

    train, steps, per_step = recipe.train, recipe.train.max_steps, rows_per_step(recipe)
    if steps is None:
        raise ValueError("a one-process distillation trains for the recipe's train.max_steps: set it")
    optimizer = torch.optim.AdamW([{"lr": train.lr, **g} for g in param_groups], lr=train.lr,
                                  weight_decay=train.weight_decay)
    schedule = get_cosine_schedule_with_warmup(optimizer, math.ceil(train.warmup_ratio * steps), steps)
    if not ray.is_initialized():
        ray.init()
    rows, _ = build_datasets(recipe.data, tokenizer_path=resolve_model(recipe.model))
    batches = rows.limit(steps * per_step).iter_torch_batches(batch_size=per_step, dtypes=torch.long)
    head = teacher.get_output_embeddings().weight
    curve, started = [], time.perf_counter()
    torch.manual_seed(train.seed)
    for step, batch in enumerate(islice(batches, steps), start=1):
        selected = batch["loss_mask"].bool()
        tokens = max(int(selected.sum()), 1)
        with torch.no_grad():
            target = teacher.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                   use_cache=False).last_hidden_state
        hidden = student.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                               use_cache=False).last_hidden_state
        width = hidden.shape[-1]
        kl = chunked_kl_sum(head, hidden.reshape(-1, width), target.reshape(-1, width), selected.reshape(-1),
                            train.temperature, train.loss_chunk_tokens)
        extra = extra_loss() if extra_loss is not None else torch.zeros(())
        (kl * train.temperature**2 / tokens + extra).backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        curve.append({"step": step, "kl": float(kl) / tokens, "extra": float(extra)})
        print(f"[{label}] step {step}/{steps} kl {curve[-1]['kl']:.4f} extra {curve[-1]['extra']:.3f} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
    return curve
