"""``swiftkv generate MODEL``: Hugging Face reference inference (student with prefill skipping)."""

from __future__ import annotations

import argparse
import time

from swiftkv.model_source import MODEL_HELP


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="chat with a checkpoint through Hugging Face generate (the reference implementation)",
        description="Apply MODEL's chat template to each PROMPT and generate them as one batch. A SwiftKV "
        "checkpoint runs as the student with prefill skipping unless --teacher is given.",
    )
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("prompt", nargs="+", help="user message(s); several prompts are generated as one batch")
    p.add_argument("--teacher", action="store_true", help="run a SwiftKV checkpoint as its base model")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from swiftkv.inference import as_student, chat_generate, load_chat_model
    from swiftkv.model_source import resolve_model

    model, tokenizer = load_chat_model(resolve_model(args.model), args.dtype)
    model = as_student(model, not args.teacher)
    start = time.perf_counter()
    answers = chat_generate(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature)
    elapsed = time.perf_counter() - start
    for prompt, ids in zip(args.prompt, answers, strict=True):
        print(f"### {prompt}\n{tokenizer.decode(ids, skip_special_tokens=True).strip()}\n")
    print(f"({len(args.prompt)} prompts, {sum(map(len, answers))} new tokens, {elapsed:.2f} s)")
    return 0
