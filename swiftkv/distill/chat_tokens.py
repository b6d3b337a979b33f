"""Chat template + loss mask: token ids of a conversation and which positions the KL counts.

Most chat templates (Llama-3.1, Qwen2.5, Mistral, SmolLM2's ChatML) have no ``{% generation %}``
markers, so transformers' ``return_assistant_tokens_mask`` cannot be used. Instead the conversation
is rendered one turn at a time: the text the template adds for an assistant turn (its content and
end-of-turn marker, after the generation prompt) is the assistant's; everything else is context.
Each piece is tokenized on its own, so the pieces' token ids line up exactly with the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from swiftkv.distill.schemas import MalformedRow, Message


@dataclass
class ChatTokens:
    input_ids: list[int]
    loss_mask: list[int]
    """``loss_mask[t] = 1`` when position ``t``'s logits are trained, i.e. when token ``t + 1`` is
    selected (an assistant token, or any token for ``loss_on="all"``)."""


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[Message], generation_prompt: bool) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def chat_pieces(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> list[tuple[str, bool]]:
    """The rendered conversation cut into ``(text, is_assistant)`` pieces that concatenate to the whole."""
    pieces: list[tuple[str, bool]] = []
    done = ""
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = _render(tokenizer, messages[:k], generation_prompt=True)
            if not prompt.startswith(done):
                raise MalformedRow("the chat template does not render this conversation turn by turn")
            pieces.append((prompt[len(done) :], False))
            done = prompt
        text = _render(tokenizer, messages[: k + 1], generation_prompt=False)
        if not text.startswith(done):
            raise MalformedRow("the chat template does not render this conversation turn by turn")
        pieces.append((text[len(done) :], message["role"] == "assistant"))
        done = text
    return pieces


def tokenize_chat(tokenizer: PreTrainedTokenizerBase, messages: list[Message], loss_on: str) -> ChatTokens:
    """Token ids of the templated conversation and its loss mask (see ``ChatTokens``)."""
    ids: list[int] = []
    selected: list[int] = []
    for text, is_assistant in chat_pieces(tokenizer, messages):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        selected.extend([int(is_assistant or loss_on == "all")] * len(piece))
    if not any(selected[1:]):
        raise MalformedRow("no token to train on after templating")
    # Position t predicts token t + 1: shift the selection left by one.
    return ChatTokens(input_ids=ids, loss_mask=selected[1:] + [0])
