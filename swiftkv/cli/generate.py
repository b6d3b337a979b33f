"""``swiftkv generate MODEL``: Hugging Face reference inference (student with prefill skipping)."""

from __future__ import annotations

import argparse
import time


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="chat with a checkpoint through Hugging Face generate (the reference implementation)",
        description="Apply MODEL's chat template to PROMPT and generate. A SwiftKV checkpoint runs as the "
        "student with prefill skipping unless --teacher is given.",
    )
    p.add_argument("model", help="checkpoint folder or hub id")
    p.add_argument("prompt", nargs="+", help="user message(s); several prompts are generated as one batch")
    p.add_argument("--teacher", action="store_true", help="run a SwiftKV checkpoint as its base model")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import swiftkv  # noqa: F401  (registers the SwiftKV model types)

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    if hasattr(model, "swiftkv"):
        model.swiftkv(not args.teacher)
    chats = [[{"role": "user", "content": p}] for p in args.prompt]
    batch = tokenizer.apply_chat_template(
        chats, add_generation_prompt=True, return_tensors="pt", padding=True, return_dict=True
    )
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=args.max_new_tokens, **sampling,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    elapsed = time.perf_counter() - start
    prompt_len = batch["input_ids"].shape[1]
    for prompt, row in zip(args.prompt, out, strict=True):
        print(f"### {prompt}\n{tokenizer.decode(row[prompt_len:], skip_special_tokens=True).strip()}\n")
    print(f"({len(args.prompt)} x {prompt_len} prompt tokens, {elapsed:.2f} s)")
    return 0
