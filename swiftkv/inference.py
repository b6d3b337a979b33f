"""Chat generation with Hugging Face ``generate``: the reference every other runtime is held to."""

from __future__ import annotations

import torch


def chat_generate(
    model, tokenizer, prompts: list[str], max_new_tokens: int = 64, temperature: float = 0.0
) -> list[list[int]]:
    """New token ids for each user prompt, generated as one left-padded batch through the model's chat
    template. A SwiftKV model runs in whatever mode it is in (student: prefill skipping)."""
    tokenizer.padding_side = "left"
    chats = [[{"role": "user", "content": p}] for p in prompts]
    batch = tokenizer.apply_chat_template(
        chats, add_generation_prompt=True, return_tensors="pt", padding=True, return_dict=True
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
