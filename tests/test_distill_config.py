"""Bad configs and bad data sources fail at start, with messages that name the problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ray_jobs.distill import main as distill_main
from swiftkv.distill.config import load_config, parse_config
from swiftkv.distill.data import resolve_files
from tests.distill_data import ULTRACHAT_ROW, write_jsonl

CONFIGS = Path(__file__).parent.parent / "ray_jobs" / "configs"
RECIPES = [
    CONFIGS / f"{name}.yaml"
    for name in (
        "llama-3.1-8b-instruct-50",
        "llama-3.1-70b-instruct-50",
        "qwen2.5-14b-instruct-25",
        "mistral-small-instruct-50",
        "qwen3-8b-50",
        "deepseek-v2-lite-chat-45",
        "smollm2-135m-cpu",
    )
]


def _minimal(**data) -> dict:
    return {
        "model": "bundled",
        "data": {"sources": [{"uri": "bundled:chitchat", "format": "chitchat"}], **data},
        "output": {"storage_path": "/tmp/x"},
    }


def test_defaults_are_the_papers():
    cfg = parse_config(_minimal())
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.warmup_ratio) == (3e-4, 0.05, 0.05)
    assert (cfg.train.temperature, cfg.train.hidden_loss_weight, cfg.train.epochs) == (2.0, 0.0, 2)
    assert (cfg.data.max_seq_len, cfg.data.pack, cfg.data.loss_on) == (8192, True, "assistant")


def test_set_overrides_dotted_keys_with_yaml_values():
    cfg = parse_config(_minimal(), ["train.max_steps=7", "deepspeed.zero_stage=3", "data.pack=false"])
    assert (cfg.train.max_steps, cfg.deepspeed.zero_stage, cfg.data.pack) == (7, 3, False)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.learning_rate=1e-4"], "train.learning_rate: unknown key"),
        (["data.max_seq_length=512"], "data.max_seq_length: unknown key"),
        (["data.sources=[{uri: a, format: sharegpt}]"], "data.sources.0.file.format: Input should be"),
        (["data.sources=[{uri: a, format: slimorca, weight: 0.5, sample_count: 3}]"], "not both"),
        (["deepspeed.zero_stage=1"], "deepspeed.zero_stage"),
        (["train.lr"], "--set expects key=value"),
    ],
)
def test_bad_configs_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        parse_config(_minimal(), overrides)


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipes_validate(recipe):
    cfg = load_config(recipe)
    assert cfg.data.sources


def test_cli_reports_bad_key_and_bad_uri_without_starting_ray(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(_minimal()))
    assert distill_main(["--config", str(path), "--set", "train.temprature=3"]) == 2
    assert "train.temprature: unknown key" in capsys.readouterr().err
    missing = f"data.sources=[{{uri: {tmp_path}/nothing/*.parquet, format: ultrachat}}]"
    assert distill_main(["--config", str(path), "--set", missing]) == 2
    assert "matches no file" in capsys.readouterr().err
    assert distill_main(["--set", "train.max_steps=2"]) == 2
    assert "--config is required (a recipe from ray_jobs/configs/)" in capsys.readouterr().err


def test_unreadable_sources_fail_with_the_uri(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        resolve_files(str(tmp_path / "no-such-dir"))
    write_jsonl([ULTRACHAT_ROW], tmp_path / "mixed" / "a.jsonl")
    (tmp_path / "mixed" / "b.csv").write_text("x\n")
    with pytest.raises(ValueError, match=r"all be \.parquet"):
        resolve_files(str(tmp_path / "mixed" / "*"))


def _with_retrieval(**source) -> dict:
    tree = _minimal(max_seq_len=2048)
    tree["data"]["sources"].append({"synthetic": "retrieval", **source})
    return tree


def test_retrieval_sources_validate_and_name_their_errors():
    cfg = parse_config(_with_retrieval(max_tokens=2048))
    assert cfg.data.sources[1].tasks == ["passkey", "kv_lookup", "recall", "doc_qa"]
    assert cfg.init.method == "copy"  # the paper's start unless asked
    for source, message in [
        ({"max_tokens": 4096}, "4096-token rows, over max_seq_len 2048"),
        ({"tasks": ["needle"]}, "data.sources.1.retrieval.tasks.0: Input should be"),
        ({"min_tokens": 64}, "data.sources.1.retrieval.min_tokens"),
        ({"min_tokens": 1024, "max_tokens": 512}, "max_tokens 512 < min_tokens 1024"),
        ({"uri": "x"}, "data.sources.1.retrieval.uri: unknown key"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_config(_with_retrieval(**source))
    with pytest.raises(ValueError, match="init.method: Input should be"):
        parse_config(_minimal(), ["init.method=svd"])


def test_cli_names_a_missing_retrieval_filler_without_starting_ray(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(_with_retrieval(filler=str(tmp_path / "missing.txt"))))
    assert distill_main(["--config", str(path)]) == 2
    assert "missing.txt" in capsys.readouterr().err
    import ray

    assert not ray.is_initialized()
