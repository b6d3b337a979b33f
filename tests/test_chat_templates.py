"""Real chat templates with their tokenizer types, built offline: Llama-3.1 and Qwen2.5 (byte-level BPE)
and Mistral v0.3 (SentencePiece-style BPE: Metaspace, byte fallback). The ids are the whole rendered
conversation tokenized once, the loss mask selects exactly each reply and the end-of-turn text the
template puts after it, and a conversation the template refuses is a skipped row, never an error."""

from __future__ import annotations

import json
import logging
from functools import cache
from itertools import cycle
from types import SimpleNamespace

import pyarrow as pa
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import LlamaTokenizerFast, PreTrainedTokenizerFast, Qwen2TokenizerFast

from swiftkv.chat_schemas import MalformedRow
from swiftkv.distill import chat_tokens, data
from swiftkv.distill.chat_tokens import ChatTokens, assistant_spans, tokenize_chat
from swiftkv.distill.config import DataConfig, SourceConfig

# Chat templates of three model families, verbatim (they are data: the `chat_template` field of each
# model's tokenizer_config.json on the Hugging Face hub, read from public copies on GitHub since the
# hub is unreachable here):
# - meta-llama/Llama-3.1-8B-Instruct (Llama 3.1 Community License),
# - Qwen/Qwen2.5-7B-Instruct (Apache-2.0),
# - mistralai/Mistral-7B-Instruct-v0.3, Mistral's "v3" template (Apache-2.0).
LLAMA_31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""  # noqa: E501

QWEN_25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501

MISTRAL_V03 = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501

# The pre-tokenizer regexes of Llama-3's and Qwen2's tokenizer.json (data, like the templates).
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501
# ASCII only, so the conversations' "é" and "☕" take Mistral's byte fallback.
CORPUS = [
    "The capital of France is Paris. It is a large city with many people.",
    "Sure!\n\nHere are three steps:\n1. Read the question.\n2. Think about it.\n3. Answer it.",
    "Sure, I can help with that\n\nFirst, look at the map\n\nThen count to three: 1, 2, 3.",
    "You are a helpful assistant. Answer briefly and kindly.",
    "What is the weather like in the mountains today? It rains in the morning, then the sun comes out.",
    "How much does a coffee cost at the station? It costs two euros.",
]


def _byte_level(split: str, specials: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS * 3, trainer)
    return tokenizer


def _vocab_merges(tokenizer: Tokenizer) -> tuple[dict[str, int], list[tuple[str, str]]]:
    model = json.loads(tokenizer.to_str())["model"]
    return model["vocab"], [tuple(merge) for merge in model["merges"]]


@cache
def llama3() -> PreTrainedTokenizerFast:
    """Llama-3.1's tokenizer type: tokenizer.json (byte-level BPE) in a PreTrainedTokenizerFast."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return PreTrainedTokenizerFast(
        tokenizer_object=_byte_level(LLAMA3_SPLIT, specials),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        chat_template=LLAMA_31,
    )


@cache
def qwen2() -> Qwen2TokenizerFast:
    vocab, merges = _vocab_merges(_byte_level(QWEN2_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    return Qwen2TokenizerFast(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=QWEN_25,
    )


@cache
def mistral() -> LlamaTokenizerFast:
    """Mistral's tokenizer type: LlamaTokenizerFast (Metaspace "▁", byte fallback), control tokens [INST] [/INST]."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    # Trained word by word like SentencePiece: no merge crosses a space.
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials, show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 3, trainer)
    vocab, merges = _vocab_merges(tokenizer)
    return LlamaTokenizerFast(
        vocab=vocab, merges=merges, extra_special_tokens=["[INST]", "[/INST]"], chat_template=MISTRAL_V03
    )


# What each template puts after a reply (the end-of-turn text the mask selects with it):
# Llama-3.1 "<|eot_id|>", Qwen2.5 "<|im_end|>\n" (its newline is part of the turn), Mistral "</s>".
# Llama-3.1 and Mistral trim the reply; Qwen2.5 keeps it as it is.
FAMILIES = {
    "llama-3.1": (llama3, lambda reply: reply.strip() + "<|eot_id|>"),
    "qwen-2.5": (qwen2, lambda reply: reply + "<|im_end|>\n"),
    "mistral-v0.3": (mistral, lambda reply: reply.strip() + "</s>"),
}
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}


def chat(*texts: str) -> list[dict[str, str]]:
    """Alternating user/assistant messages."""
    return [{"role": role, "content": text} for role, text in zip(cycle(["user", "assistant"]), texts)]


CONVERSATIONS = {
    "one turn": chat("What is the capital of France?", "Paris is the capital of France."),
    "system, three turns": [
        SYSTEM,
        *chat(
            "How do I answer a question?",
            "Sure!\n\nHere are three steps:\n1. Read the question.\n2. Think about it.",
            "How much is a coffee at the station?",
            "It costs 2 euros at the café ☕.",
            "Thanks, that is kind.",
            "  Kindly: you are welcome.  ",
        ),
    ],
    # Mistral v0.3 moves the system prompt into the last user turn, here the final one.
    "system, ends on a user turn": [SYSTEM, *chat("Hi there.", "Hello! How can I help?", "What is the weather like?")],
    # Whole-text byte-level BPE merges the template's "\n" with the reply's: "ĊĊ".
    "reply starts with a newline": chat("Count to three.", "\nSure: 1, 2, 3."),
}


@pytest.fixture(params=list(FAMILIES))
def family(request) -> tuple[PreTrainedTokenizerFast, object]:
    build, reply = FAMILIES[request.param]
    return build(), reply


def selected_runs(tokens: ChatTokens) -> list[list[int]]:
    """The selected tokens (those trained positions predict), one list per unbroken run."""
    runs: list[list[int]] = []
    for t, trained in enumerate(tokens.loss_mask):
        if trained:
            if t == 0 or not tokens.loss_mask[t - 1]:
                runs.append([])
            runs[-1].append(tokens.input_ids[t + 1])
    return runs


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_ids_are_the_whole_rendered_conversation_tokenized_once(family, name):
    tokenizer, _ = family
    messages = CONVERSATIONS[name]
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    expected = tokenizer(whole, add_special_tokens=False)["input_ids"]
    assert tokenize_chat(tokenizer, messages, loss_on="assistant").input_ids == expected
    assert tokenize_chat(tokenizer, messages, loss_on="all").loss_mask == [1] * (len(expected) - 1) + [0]


@pytest.mark.parametrize("name", ["one turn", "system, three turns", "system, ends on a user turn"])
def test_selected_tokens_are_each_reply_and_its_end_of_turn_text(family, name):
    tokenizer, reply = family
    messages = CONVERSATIONS[name]
    runs = selected_runs(tokenize_chat(tokenizer, messages, loss_on="assistant"))
    replies = [reply(m["content"]) for m in messages if m["role"] == "assistant"]
    assert [tokenizer.decode(run) for run in runs] == replies


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_one_rendering_with_every_reply_marked_gives_the_per_reply_spans(family, name, monkeypatch):
    """The fast path (one rendering, every reply marked) finds the spans one rendering per reply finds,
    and it is taken unless the template trims a reply that has spaces at its ends."""
    tokenizer, reply = family
    messages = CONVERSATIONS[name]
    text, spans = assistant_spans(tokenizer, messages)
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    trimmed = any(not reply(messages[k]["content"]).startswith(messages[k]["content"]) for k in turns)
    assert (chat_tokens._spans_in_one_rendering(tokenizer, messages, text, turns) is None) == trimmed
    monkeypatch.setattr(chat_tokens, "_spans_in_one_rendering", lambda *args: None)
    assert assistant_spans(tokenizer, messages) == (text, spans)


def test_a_token_shared_by_template_text_and_reply_is_the_replys():
    """A token straddling a reply's start carries reply text, so it is selected."""
    (run,) = selected_runs(tokenize_chat(qwen2(), CONVERSATIONS["reply starts with a newline"], loss_on="assistant"))
    assert qwen2().convert_ids_to_tokens(run[0]) == "ĊĊ"  # the template's "\n" and the reply's first "\n"
    assert qwen2().decode(run) == "\n\nSure: 1, 2, 3.<|im_end|>\n"
    (run,) = selected_runs(tokenize_chat(mistral(), CONVERSATIONS["one turn"], loss_on="assistant"))
    assert mistral().convert_ids_to_tokens(run[0]).startswith("▁")  # the template's space before the reply


def test_a_conversation_the_template_refuses_is_a_malformed_row():
    messages = [*chat("Hi.", "Hello!"), {"role": "assistant", "content": "Anything else?"}]
    with pytest.raises(MalformedRow, match="roles must alternate"):
        tokenize_chat(mistral(), messages, loss_on="assistant")


def test_tokenize_and_pack_counts_a_refused_conversation_as_skipped(tmp_path, caplog):
    mistral().save_pretrained(tmp_path)
    good = CONVERSATIONS["one turn"]
    refused = [*chat("Hi.", "Hello!"), {"role": "assistant", "content": "Anything else?"}]
    batch = pa.Table.from_pylist([{"messages": good}, {"messages": refused}], schema=data.MESSAGES_SCHEMA)
    cfg = DataConfig(sources=[SourceConfig(uri="unused.jsonl", format="messages")], max_seq_len=128)
    with caplog.at_level(logging.WARNING, logger=data.logger.name):
        rows = data._tokenize_and_pack(batch, str(tmp_path), cfg)
    assert "skipped 1 conversation(s)" in caplog.text
    assert rows["loss_mask"].sum() == sum(tokenize_chat(mistral(), good, loss_on="assistant").loss_mask)


def test_a_slow_tokenizer_is_refused_saying_what_to_load():
    with pytest.raises(ValueError, match="slow tokenizer without offset mappings; load the model's fast tokenizer"):
        tokenize_chat(SimpleNamespace(is_fast=False), CONVERSATIONS["one turn"], loss_on="assistant")
