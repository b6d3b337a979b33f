"""The distillation step, current vs new, side by side in one run: step time and activation memory.

    python -m benchmarks.bench_distill --models bundled random-llama --seq-len 512 --steps 4
    python -m benchmarks.bench_distill --models random-llama-8b --data synthetic --dtype bfloat16 \
        --seq-len 4096 --steps 8   # on a GPU: the 8B-shaped random Llama

"current" runs the teacher and the student whole (layers ``0..c-1`` twice, the student keeping
their activations); "new" (``train.reuse_teacher_prefix``, the default) runs layers ``0..c-1``
once and starts both from the state entering layer ``c``. Both compute the same loss and gradients
(``tests/test_distill_loss.py`` checks it bit for bit). The two variants alternate step by step on
the same packed bundled conversations (``--data bundled``; their assistant tokens selected) or on
random tokens packed as examples of 512 (or the row, if shorter) whose second halves are selected (``--data synthetic``,
which needs neither the bundled tokenizer nor Ray), so machine load hits both alike. A step is the objective's
forward (teacher, student, chunked KL through the LM head) and backward; the optimizer, the same for
both, is left out. Activation memory is what autograd saves for backward (bytes of the distinct
tensors, measured with saved-tensor hooks on any device); on CUDA the peak allocated memory of the
step is reported too. One process, no Ray or DeepSpeed. Writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import weakref
from pathlib import Path

import numpy as np
import torch

from swiftkv.convert import convert_model
from swiftkv.distill.chat_tokens import ChatTokens, tokenize_chat
from swiftkv.distill.model_io import load_student
from swiftkv.distill.objective import DistillationObjective, freeze_all_but_swiftkv
from swiftkv.distill.packing import pack_rows
from swiftkv.model_source import resolve_model
from swiftkv.random_llama import NAME as RANDOM_LLAMA
from swiftkv.random_llama import SHAPES, random_llama

VARIANTS = {"current": False, "new": True}  # name -> reuse_teacher_prefix


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


SYNTHETIC_EXAMPLE_TOKENS = 512


def bundled_examples(model_path: str | None, count: int) -> tuple[list[ChatTokens], int]:
    """(``count`` bundled conversations tokenized with the model's tokenizer (the bundled one for a
    random Llama, ``model_path`` None), assistant tokens selected; its pad id)."""
    # Imported here: the data pipeline imports Ray, which --data synthetic does without.
    from swiftkv.bundled import bundled_chat_data
    from swiftkv.distill.data import load_tokenizer, pad_id

    tokenizer = load_tokenizer(model_path or resolve_model("bundled"))
    return [tokenize_chat(tokenizer, m, "assistant") for m in bundled_chat_data(limit=count)], pad_id(tokenizer)


def synthetic_examples(count: int, tokens: int, vocab_size: int) -> tuple[list[ChatTokens], int]:
    """(``count`` examples of ``tokens`` random tokens, the second half of each selected; pad id 0)."""
    generator = torch.Generator().manual_seed(0)
    return [ChatTokens(torch.randint(10, vocab_size, (tokens,), generator=generator).tolist(),
                       [0] * (tokens // 2) + [1] * (tokens - tokens // 2)) for _ in range(count)], 0


def packed_batches(data: str, model_path: str | None, vocab_size: int, seq_len: int, batch_size: int,
                   count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of ``batch_size`` packed rows of ``seq_len`` tokens."""
    rows_needed = count * batch_size
    if data == "bundled":
        examples, pad = bundled_examples(model_path, rows_needed * 8)
    else:
        tokens = min(SYNTHETIC_EXAMPLE_TOKENS, seq_len)
        examples, pad = synthetic_examples(rows_needed * -(-seq_len // tokens), tokens, vocab_size)
    rows = pack_rows(examples, seq_len, pad)[:rows_needed]
    if len(rows) < rows_needed:
        raise ValueError("not enough bundled conversations for that many rows: lower --steps or --batch-size")
    return [
        {key: torch.as_tensor(np.stack([r[key] for r in rows[i : i + batch_size]])) for key in rows[0]}
        for i in range(0, len(rows), batch_size)
    ]


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward while open. A storage is known by
    its address while a tensor saved from it lives: the chunked loss frees a chunk's graph before
    the next, and an address the allocator hands out again is a new storage, not one seen before
    (counting it once made the figure vary by a chunk's logits from step to step)."""

    def __init__(self) -> None:
        self.total = 0
        self._seen: dict[tuple[int, int], weakref.ref] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), tensor.device.index or 0)
        known = self._seen.get(key)
        if known is None or known() is None:
            self.total += storage.nbytes()
            self._seen[key] = weakref.ref(tensor)
        return tensor

    def __enter__(self) -> SavedBytes:
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)


def load_model(name: str, dtype: torch.dtype, device: torch.device):
    """(the student at 50% SwiftKV of a random Llama, made on ``device``, or of a model reference;
    the model's folder, None for a random Llama)."""
    if name in SHAPES:
        return convert_model(random_llama(dtype, name, device)), None
    path = resolve_model(name)
    return load_student(path, None, 1, dtype).to(device), path


def measure(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    model, path = load_model(name, getattr(torch, args.dtype), device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    trainable = freeze_all_but_swiftkv(model)
    model.train()
    objectives = {name: DistillationObjective(model, 2.0, 0.0, args.chunk, reuse_teacher_prefix=reuse)
                  for name, reuse in VARIANTS.items()}
    batches = packed_batches(args.data, path, model.config.vocab_size, args.seq_len, args.batch_size,
                             args.steps + 1)
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    saved: dict[str, int] = {}
    peak: dict[str, int] = {}
    for i, batch in enumerate(batches):
        batch = {k: v.to(device) for k, v in batch.items()}
        scale = 1.0 / max(int(batch["loss_mask"].sum()), 1)
        for name, objective in objectives.items():
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            _sync()
            start = time.perf_counter()
            with SavedBytes() as bytes_saved:
                loss = objective(**batch, token_scale=scale).loss
            loss.backward()
            _sync()
            elapsed = time.perf_counter() - start
            for p in trainable:
                p.grad = None
            if i == 0:
                continue  # warm-up
            seconds[name].append(elapsed)
            saved[name] = bytes_saved.total
            if torch.cuda.is_available():
                peak[name] = torch.cuda.max_memory_allocated() - before
        if i:
            print(f"step {i}/{args.steps}: " + ", ".join(f"{n} {seconds[n][-1]:.2f}s" for n in VARIANTS), flush=True)
    step = {name: statistics.median(times) for name, times in seconds.items()}
    return {
        "num_hidden_layers": model.config.num_hidden_layers,
        "num_key_value_layers": model.config.num_key_value_layers,
        "step_s_median": step,
        "step_ratio_new_over_current": step["new"] / step["current"],
        "tokens_per_s": {name: args.seq_len * args.batch_size / s for name, s in step.items()},
        "activation_bytes": saved,
        "activation_ratio_new_over_current": saved["new"] / saved["current"],
        **({"cuda_peak_bytes": peak} if peak else {}),
        "trainable_params": sum(p.numel() for p in trainable),
        "total_params": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["bundled", RANDOM_LLAMA],
                        help=f"model references, or random Llamas {', '.join(SHAPES)} (default: bundled SmolLM2 and "
                        f"{RANDOM_LLAMA}); each at 50%% SwiftKV")
    parser.add_argument("--data", default="bundled", choices=["bundled", "synthetic"],
                        help="packed bundled conversations, or random tokens (no tokenizer, no Ray)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant (after one warm-up step)")
    parser.add_argument("--chunk", type=int, default=256, help="loss chunk (tokens)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("artifacts/bench_distill.json"))
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "data": args.data,
               "dtype": args.dtype, "seq_len": args.seq_len, "batch_size": args.batch_size,
               "steps": args.steps, "gradient_checkpointing": args.gradient_checkpointing, "models": {}}
    for name in args.models:
        print(f"== {name}", flush=True)
        results["models"][name] = measure(name, args, device)
        r = results["models"][name]
        print(f"{name}: step new/current {r['step_ratio_new_over_current']:.3f}, "
              f"activation memory new/current {r['activation_ratio_new_over_current']:.3f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
