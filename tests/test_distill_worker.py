"""The distillation worker's training step on a one-rank gloo group, as a Ray Train worker runs it
(no Ray needed): the model trains in training mode, so gradient checkpointing really recomputes."""

from __future__ import annotations

import numpy as np
import torch

from swiftkv.bundled import copy_bundled_tokenizer
from swiftkv.distill.config import parse_config
from swiftkv.distill.train_loop import Worker
from tests.test_distill_model_io import one_rank_group  # noqa: F401  (fixture)
from tests.tiny import tiny_swiftkv_model


def _batch(seq_len: int = 64) -> dict[str, torch.Tensor]:
    gen = np.random.default_rng(0)
    mask = np.zeros(seq_len, dtype=np.int64)
    mask[10:40] = 1
    return {"input_ids": torch.as_tensor(gen.integers(3, 1000, (1, seq_len))),
            "position_ids": torch.arange(seq_len)[None], "loss_mask": torch.as_tensor(mask)[None]}


def test_gradient_checkpointing_recomputes_the_later_layers(one_rank_group, tmp_path):  # noqa: F811
    """A layer after the cutoff runs twice per step for the student when checkpointing is on (once
    forward, once recomputed in backward), once when it is off; the model loaded by from_pretrained
    starts in eval mode, where transformers would skip checkpointing without a word."""
    tiny_swiftkv_model("llama", num_hidden_layers=4, num_key_value_layers=2).save_pretrained(tmp_path / "m")
    copy_bundled_tokenizer(tmp_path / "m")
    for checkpointing, student_layer_runs in ((False, 1), (True, 2)):
        cfg = parse_config({"model": str(tmp_path / "m"), "output": {"storage_path": str(tmp_path)},
                            "data": {"sources": [{"uri": "x.jsonl", "format": "messages"}]},
                            "train": {"gradient_checkpointing": checkpointing}})
        worker = Worker(cfg, total_steps=2, rank=0, world_size=1, device=torch.device("cpu"))
        runs: list[int] = []
        # A pre-hook: recomputation in backward stops early, before the layer's forward hooks would run.
        hook = worker.model.model.layers[3].register_forward_pre_hook(
            lambda *_, seen=runs: seen.append(1) if torch.is_grad_enabled() else None)
        _, kl, tokens = worker._step([_batch()])
        hook.remove()
        assert (len(runs), tokens) == (student_layer_runs, 30) and kl > 0, checkpointing
