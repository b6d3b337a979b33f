"""Distillation data pieces: schema mapping, chat template + assistant mask, packing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from swiftkv.bundled import ensure_bundled_model
from swiftkv.chat_schemas import MalformedRow, to_messages
from swiftkv.distill.chat_tokens import ChatTokens, tokenize_chat
from swiftkv.distill.packing import pack_rows
from tests.distill_data import CHITCHAT_ROW, OPENHERMES_ROW, SLIMORCA_ROW, ULTRACHAT_ROW
from tests.tiny import tiny_swiftkv_model


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_bundled_model())


def test_public_schemas_map_to_messages():
    assert to_messages("ultrachat", ULTRACHAT_ROW) == ULTRACHAT_ROW["messages"]
    hermes = to_messages("openhermes", OPENHERMES_ROW)
    assert [m["role"] for m in hermes] == ["system", "user", "assistant"]
    assert hermes[2]["content"] == OPENHERMES_ROW["conversations"][2]["value"]
    assert [m["role"] for m in to_messages("slimorca", SLIMORCA_ROW)] == ["system", "user", "assistant"]
    chat = to_messages("chitchat", CHITCHAT_ROW)
    assert [m["role"] for m in chat] == ["user", "assistant"]
    assert chat[0]["content"] == "Hello\nHow are you?"


@pytest.mark.parametrize(
    "fmt,row,problem",
    [
        ("ultrachat", {"messages": []}, "no non-empty list in column 'messages'"),
        ("ultrachat", {"messages": [{"role": "bot", "content": "x"}]}, "role 'bot'"),
        ("openhermes", {"conversations": [{"from": "human", "value": "hi"}]}, "no assistant turn"),
        ("slimorca", {"conversations": [{"from": "gpt", "value": None}]}, "conversations[0].value"),
        ("chitchat", {"messages": "not a list"}, "no non-empty list"),
    ],
)
def test_malformed_rows_say_what_is_wrong(fmt, row, problem):
    with pytest.raises(MalformedRow, match=problem.replace("[", r"\[").replace("]", r"\]")):
        to_messages(fmt, row)


def test_unknown_format_is_an_error():
    with pytest.raises(ValueError, match="unknown data format 'sharegpt'"):
        to_messages("sharegpt", {})


def test_assistant_mask_selects_exactly_the_assistant_replies(tokenizer):
    messages = to_messages("openhermes", OPENHERMES_ROW)
    tokens = tokenize_chat(tokenizer, messages, loss_on="assistant")
    # The ids are the template's own tokenization of the whole conversation.
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(tokens.input_ids) == whole
    # Position t is selected when token t+1 belongs to the reply (its text and end-of-turn marker).
    targets = [tokens.input_ids[t + 1] for t, m in enumerate(tokens.loss_mask) if m]
    assert tokenizer.decode(targets).strip() == messages[2]["content"] + "<|im_end|>"
    everything = tokenize_chat(tokenizer, messages, loss_on="all")
    assert everything.input_ids == tokens.input_ids
    assert sum(everything.loss_mask) == len(tokens.input_ids) - 1


def _example(n: int, seed: int) -> ChatTokens:
    gen = np.random.default_rng(seed)
    return ChatTokens(gen.integers(3, 1000, n).tolist(), [1] * (n - 1) + [0])


def test_packing_fills_rows_and_restarts_positions():
    rows = pack_rows([_example(n, i) for i, n in enumerate([5, 9, 3, 7, 12])], max_seq_len=16, pad_id=2)
    assert all(len(r["input_ids"]) == 16 for r in rows)
    assert sum(int((r["input_ids"] != 2).sum()) for r in rows) == 36  # no token lost
    assert len(rows) == 3  # first-fit decreasing: 12+3, 9+7, 5
    assert list(rows[1]["position_ids"]) == list(range(9)) + list(range(7))
    unpacked = pack_rows([_example(5, 0)], max_seq_len=16, pad_id=2, pack=False)
    assert list(unpacked[0]["loss_mask"]) == [1] * 4 + [0] * 12


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_packed_row_gives_each_example_its_own_logits(family, attn):
    """No token attends across examples: each example's logits in a packed row equal its logits alone,
    for the teacher and the student (the student's SwiftKV K/V must stay inside the example too)."""
    model = tiny_swiftkv_model(family, num_hidden_layers=4, num_key_value_layers=2)
    model.config._attn_implementation = attn
    examples = [_example(n, i) for i, n in enumerate([11, 30, 6])]
    (row,) = pack_rows(examples, max_seq_len=64, pad_id=2)
    ids = torch.as_tensor(row["input_ids"])[None]
    pos = torch.as_tensor(row["position_ids"])[None]
    for swiftkv in (False, True):
        model.swiftkv(swiftkv)
        with torch.no_grad():
            packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
            start = 0
            for ex in sorted(examples, key=lambda e: -len(e.input_ids)):  # the packer's order
                n = len(ex.input_ids)
                assert ids[0, start : start + n].tolist() == ex.input_ids
                alone = model(input_ids=torch.tensor([ex.input_ids]), use_cache=False).logits[0]
                torch.testing.assert_close(packed[start : start + n], alone, rtol=1e-4, atol=1e-4)
                start += n


# --- synthetic retrieval chats ------------------------------------------------------------------


@pytest.mark.parametrize("task", ["passkey", "kv_lookup", "recall", "doc_qa"])
def test_retrieval_rows_hold_their_answer_far_back_at_the_asked_length(tokenizer, task):
    from swiftkv.distill.retrieval_data import retrieval_chat

    for index in range(6):
        messages = retrieval_chat(index, [task], "bundled:squad", 512, 2048, 3, tokenizer)
        assert messages == retrieval_chat(index, [task], "bundled:squad", 512, 2048, 3, tokenizer)  # seeded
        length = len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        assert 256 <= length <= 2048, length
        assert messages[-1]["role"] == "assistant" and messages[-2]["role"] == "user"
        context = "\n".join(m["content"] for m in messages[:-1])
        # The value the reply gives is stated earlier in the prompt, not in the question's own turn.
        value = messages[-1]["content"].removesuffix(".").split()[-1] if task != "doc_qa" else messages[-1]["content"]
        earlier = "\n".join(m["content"] for m in messages[:-2]) if task == "recall" else context
        assert value in earlier, (task, value)
        if task == "recall":
            assert len(messages) >= 6 and value not in messages[-2]["content"]
    other = retrieval_chat(0, [task], "bundled:squad", 512, 2048, 4, tokenizer)
    assert other != retrieval_chat(0, [task], "bundled:squad", 512, 2048, 3, tokenizer)  # the seed matters


def test_short_document_questions_fit_their_row(tokenizer):
    # A SQuAD paragraph can be longer than a short row by itself: the row takes a question whose own
    # paragraph fits, so no row of the shortest allowed range runs past its length.
    from swiftkv.distill.retrieval_data import check_retrieval_spec, retrieval_chat

    check_retrieval_spec(["doc_qa"], "bundled:squad", 192, 384, tokenizer)
    for index in range(40):
        messages = retrieval_chat(index, ["doc_qa"], "bundled:squad", 192, 384, 0, tokenizer)
        length = len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        assert length <= 384, (index, length)


def test_retrieval_spec_errors_name_the_problem(tokenizer, tmp_path):
    from swiftkv.distill.retrieval_data import check_retrieval_spec

    with pytest.raises(FileNotFoundError, match="no-such.txt"):
        check_retrieval_spec(["passkey"], str(tmp_path / "no-such.txt"), 512, 1024, tokenizer)
    (tmp_path / "notes.txt").write_text("A paragraph of my own text that is long enough.\n\n" * 400)
    check_retrieval_spec(["passkey", "kv_lookup"], str(tmp_path / "notes.txt"), 512, 1024, tokenizer)
    with pytest.raises(ValueError, match=r"\['doc_qa'\] need a filler with questions"):
        check_retrieval_spec(["passkey", "doc_qa"], str(tmp_path / "notes.txt"), 512, 1024, tokenizer)
    with pytest.raises(ValueError, match="unknown retrieval task"):
        check_retrieval_spec(["needle"], "bundled:squad", 512, 1024, tokenizer)
    (tmp_path / "short.txt").write_text("Too little filler for a long row.")
    with pytest.raises(ValueError, match="cannot make a 512-token row from filler .*short.txt"):
        check_retrieval_spec(["passkey"], str(tmp_path / "short.txt"), 512, 4096, tokenizer)
