"""Chat generation with Hugging Face ``generate``: the reference every other runtime is held to."""

from __future__ import annotations

import torch

Chat = str | list[dict[str, str]]
"""A user prompt, or a whole conversation (``[{"role", "content"}, ...]``) ending on a user turn or
on the start of the assistant's reply, which the model then continues."""


def load_chat_model(path: str, dtype: str = "float32"):
    """``(model, tokenizer)`` of a checkpoint folder in eval mode (SwiftKV checkpoints included)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    return model, AutoTokenizer.from_pretrained(path)


def as_student(model, enabled: bool = True):
    """A SwiftKV model switched to its student (prefill skipping) or teacher; any other model as it is."""
    return model.swiftkv(enabled) if hasattr(model, "swiftkv") else model


def chat_generate(
    model, tokenizer, chats: list[Chat], max_new_tokens: int = 64, temperature: float = 0.0
) -> list[list[int]]:
    """New token ids for each chat, generated as one left-padded batch through the model's chat
    template. A SwiftKV model runs in whatever mode it is in (student: prefill skipping)."""
    tokenizer.padding_side = "left"
    messages = [[{"role": "user", "content": c}] if isinstance(c, str) else c for c in chats]
    started = {m[-1]["role"] == "assistant" for m in messages}
    if len(started) > 1:
        raise ValueError("a batch mixes conversations ending on a user turn and on a started reply")
    continues = started.pop()
    batch = tokenizer.apply_chat_template(
        messages, add_generation_prompt=not continues, continue_final_message=continues, return_tensors="pt",
        padding=True, return_dict=True
    )
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=pad, **sampling)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    width = batch["input_ids"].shape[1]
    answers = []
    for row in out[:, width:].tolist():
        # Cut after the first end-of-sequence token (generate pads finished rows with it).
        stop = next((i for i, t in enumerate(row) if t in eos_ids), len(row) - 1)
        answers.append(row[: stop + 1])
    return answers
