"""Distillation step throughput and where the step time goes, on one device (no Ray, no DeepSpeed).

    python -m benchmarks.bench_distill --model bundled --num-key-value-layers 15 --seq-len 512 --steps 6

Each step is timed in phases: teacher forward (no grad), student forward, loss (chunked KL through
the LM head, including its gradient), backward, optimizer. Tokens/s counts every token of the
packed rows. Use the per-phase shares to size the GPU recipes: the paper distils 680M tokens
in 3 h on 8 H100 for Llama-3.1-8B (about 7.9K tokens/s per GPU). Writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from swiftkv.bundled import bundled_chat_data
from swiftkv.distill.chat_tokens import tokenize_chat
from swiftkv.distill.data import load_tokenizer, pad_id
from swiftkv.distill.loss import chunked_kl_sum
from swiftkv.distill.model_io import load_student
from swiftkv.distill.objective import DistillationObjective, freeze_all_but_swiftkv
from swiftkv.distill.packing import pack_rows
from swiftkv.model_source import resolve_model

PHASES = ("teacher_forward", "student_forward", "loss", "backward", "optimizer")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def _timed(times: dict[str, list[float]], phase: str):
    _sync()
    start = time.perf_counter()
    yield
    _sync()
    times[phase].append(time.perf_counter() - start)


def packed_batches(tokenizer, seq_len: int, batch_size: int, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of packed bundled conversations (assistant tokens selected)."""
    examples = [tokenize_chat(tokenizer, m, "assistant") for m in bundled_chat_data(limit=count * batch_size * 8)]
    rows = pack_rows(examples, seq_len, pad_id(tokenizer))[: count * batch_size]
    if len(rows) < count * batch_size:
        raise ValueError("not enough bundled conversations for that many rows: lower --steps or --batch-size")
    return [
        {key: torch.as_tensor(np.stack([r[key] for r in rows[i : i + batch_size]])) for key in rows[0]}
        for i in range(0, len(rows), batch_size)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled", help="base or SwiftKV checkpoint (default: bundled SmolLM2)")
    parser.add_argument("--num-key-value-layers", type=int, default=None, help="cutoff c (default: half)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6, help="timed steps (after one warm-up step)")
    parser.add_argument("--chunk", type=int, default=256, help="loss chunk (tokens)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("artifacts/bench_distill.json"))
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    model = load_student(path, args.num_key_value_layers, 1, getattr(torch, args.dtype)).to(device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    trainable = freeze_all_but_swiftkv(model)
    objective = DistillationObjective(model, temperature=2.0, hidden_loss_weight=0.0, chunk_tokens=args.chunk)
    optimizer = torch.optim.AdamW(trainable, lr=3e-4, weight_decay=0.05)
    head = model.get_output_embeddings()
    batches = packed_batches(tokenizer, args.seq_len, args.batch_size, args.steps + 1)

    times: dict[str, list[float]] = {p: [] for p in PHASES}
    for i, batch in enumerate(batches):
        batch = {k: v.to(device) for k, v in batch.items()}
        step_times: dict[str, list[float]] = {p: [] for p in PHASES}
        ids, pos, selected = batch["input_ids"], batch["position_ids"], batch["loss_mask"].bool()
        with _timed(step_times, "teacher_forward"), torch.no_grad():
            teacher = objective.hidden(False, ids, pos).last_hidden_state
        with _timed(step_times, "student_forward"):
            student = objective.hidden(True, ids, pos).last_hidden_state
        with _timed(step_times, "loss"):
            width = student.shape[-1]
            kl = chunked_kl_sum(
                head, student.reshape(-1, width), teacher.reshape(-1, width), selected.reshape(-1), 2.0, args.chunk
            )
            loss = kl / selected.sum().clamp(min=1) * 4.0
        with _timed(step_times, "backward"):
            loss.backward()
        with _timed(step_times, "optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if i == 0:
            continue  # warm-up
        for p in PHASES:
            times[p] += step_times[p]
        total = sum(step_times[p][0] for p in PHASES)
        print(f"step {i}/{args.steps}: {total:.2f}s, {ids.numel() / total:.0f} tok/s", flush=True)

    step = [sum(times[p][i] for p in PHASES) for i in range(args.steps)]
    result = {
        "model": args.model,
        "num_key_value_layers": model.config.num_key_value_layers,
        "num_hidden_layers": model.config.num_hidden_layers,
        "device": str(device),
        "dtype": args.dtype,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "tokens_per_s": args.seq_len * args.batch_size / statistics.median(step),
        "step_s_median": statistics.median(step),
        "share": {p: sum(times[p]) / sum(step) for p in PHASES},
        "trainable_params": sum(p.numel() for p in trainable),
        "total_params": sum(p.numel() for p in model.parameters()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
