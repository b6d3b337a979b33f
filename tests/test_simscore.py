"""SimScore: layer inputs and padding handled right (checked against forward hooks), SwiftKV
checkpoints scored as their teacher, data formats, the suggestion rule, and a small real run."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from swiftkv.analysis.simscore import (
    compute_simscore,
    layer_similarity,
    load_conversations,
    simscore_curve,
    suggest_cutoffs,
)
from swiftkv.cli import main
from tests.tiny import tiny_swiftkv_model, tiny_tokenizer


def _hooked_similarity(model, batch) -> torch.Tensor:
    """Brute force: capture each layer's input with hooks, then average per-token cosines over the
    tokens the attention mask keeps."""
    inputs = []
    hooks = [
        layer.register_forward_pre_hook(
            lambda _, args, kwargs: inputs.append(kwargs.get("hidden_states", args[0] if args else None)),
            with_kwargs=True,
        )
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(**batch, use_cache=False)
    for hook in hooks:
        hook.remove()
    n = len(inputs)
    keep = batch["attention_mask"].bool()
    sim = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            sim[i, j] = torch.cosine_similarity(inputs[i][keep], inputs[j][keep], dim=-1).double().mean()
    return sim


def _padded_batch():
    ids = torch.randint(3, 1000, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding on the second row
    ids[1, 7:] = 2
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("family", ["llama", "qwen2", "deepseek_v2"])
def test_similarity_matches_hooked_layer_inputs(family):
    model = tiny_swiftkv_model(family, num_hidden_layers=4, num_key_value_layers=2).swiftkv(False)
    batch = _padded_batch()
    similarity, tokens = layer_similarity(model, [batch])
    assert tokens == 12 + 7
    torch.testing.assert_close(similarity, _hooked_similarity(model, batch), rtol=0, atol=1e-5)
    # Padding must not count: the same tokens without padding rows give the same matrix.
    unpadded = [{k: v[i : i + 1, : int(batch["attention_mask"][i].sum())] for k, v in batch.items()} for i in (0, 1)]
    torch.testing.assert_close(layer_similarity(model, unpadded)[0], similarity, rtol=0, atol=1e-5)
    curve = simscore_curve(similarity)
    assert len(curve) == 3 and curve[1] == pytest.approx(similarity[1, 2:].mean().item())


def test_suggestion_rule():
    # 8 layers: SimScore(0..6); a dip at 5 blocks every cutoff at or below it.
    curve = [0.1, 0.3, 0.4, 0.6, 0.7, 0.45, 0.8]
    targets, recommended = suggest_cutoffs(curve, threshold=0.5)
    assert [(t.share, t.num_key_value_layers, t.below_threshold) for t in targets] == [
        (0.25, 6, False),
        (0.5, 4, False),
        (0.75, 2, True),
    ]
    assert recommended == 6
    assert suggest_cutoffs([0.9] * 7, 0.5)[1] == 4  # never past half depth
    assert suggest_cutoffs([0.9] * 6 + [0.2], 0.5)[1] is None


def _write_chat_files(tmp_path):
    messages = [{"role": "user", "content": "w1 w2 w3 w4"}, {"role": "assistant", "content": "w5 w6 w7"}]
    sharegpt = {"conversations": [{"from": "human", "value": "w8 w9"}, {"from": "gpt", "value": "w10 w11 w12"}]}
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text(
        "\n".join(json.dumps(r) for r in [{"messages": messages}, {"no": "chat"}, sharegpt, messages]) + "\n"
    )
    parquet = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": messages}] * 3), parquet)
    return jsonl, parquet


def test_data_formats_and_errors(tmp_path):
    jsonl, parquet = _write_chat_files(tmp_path)
    conversations = load_conversations(jsonl, 10)
    assert len(conversations) == 3  # the malformed row is skipped
    assert conversations[1] == [
        {"role": "user", "content": "w8 w9"},
        {"role": "assistant", "content": "w10 w11 w12"},
    ]
    assert load_conversations(parquet, 2) == [conversations[0]] * 2
    bundled = load_conversations("bundled", 3)
    assert len(bundled) == 3 and bundled[0][0]["role"] == "user"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_conversations(tmp_path / "missing.jsonl", 2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "plain"}) + "\n")
    with pytest.raises(ValueError, match="no usable chat conversations"):
        load_conversations(bad, 2)
    csv = tmp_path / "chat.csv"
    csv.write_text("messages\n")
    with pytest.raises(ValueError, match="unknown data file type"):
        load_conversations(csv, 2)


def test_swiftkv_checkpoint_is_scored_as_its_teacher(tmp_path):
    model = tiny_swiftkv_model("llama", num_hidden_layers=4, num_key_value_layers=1)
    model.save_pretrained(tmp_path / "model")
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(tmp_path / "model")
    jsonl, _ = _write_chat_files(tmp_path)
    result = compute_simscore(tmp_path / "model", jsonl, num_samples=3, max_len=64, batch_size=2)

    batch = tokenizer(
        [tokenizer.apply_chat_template(c, tokenize=False) for c in load_conversations(jsonl, 3)],
        add_special_tokens=False,
        padding=True,
        return_tensors="pt",
    )
    teacher, _ = layer_similarity(model.swiftkv(False), [batch])
    student, _ = layer_similarity(model.swiftkv(True), [batch])
    torch.testing.assert_close(torch.tensor(result.similarity, dtype=torch.float64), teacher, rtol=0, atol=1e-5)
    assert not torch.allclose(teacher, student, atol=1e-3)  # the check above can tell them apart


def test_bundled_model_cli_run(tmp_path, capsys):
    out = tmp_path / "simscore"
    argv = ["simscore", "bundled", "--num-samples", "8", "--max-len", "128", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "simscore.json").read_text())
    assert len(result["simscore"]) == 29 and len(result["similarity"]) == 30
    assert all(s == pytest.approx(1.0, abs=1e-4) for s in (result["similarity"][i][i] for i in range(30)))
    # SmolLM2's late layers are far more alike than its early ones (NOTES.md: about 0.54 vs 0.8).
    assert result["simscore"][26] > result["simscore"][1] + 0.1
    assert (out / "simscore.png").stat().st_size > 10_000 and (out / "similarity.png").stat().st_size > 10_000
    assert "recommended cutoff" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bundled", "--data", "nowhere.jsonl"], "data file nowhere.jsonl does not exist"),
        (["./missing-model", "--num-samples", "2"], "model folder ./missing-model does not exist"),
        (
            ["missing-model", "--num-samples", "2"],
            "model 'missing-model' is not a local folder, 'bundled', 'bundled-swiftkv', a remote",
        ),
        (["bundled", "--num-samples", "0"], "num_samples must be >= 1"),
        (["bundled", "--max-len", "1"], "max_len must be >= 2"),
    ],
)
def test_cli_errors(argv, message, capsys):
    assert main(["simscore", *argv]) == 2
    assert message in capsys.readouterr().err
