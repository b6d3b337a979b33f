"""The serving tools as a user runs them: ``swiftkv calibrate`` measures a replica's prefill rate
with a real engine in a Ray task, and the load-test job runs end to end on a tiny model (real Serve,
real vLLM, vLLM's own benchmark client) and writes its JSON, report and plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swiftkv.bundled import copy_bundled_tokenizer
from tests.serve_cluster import CACHE, CPU_ENV, engine_processes
from tests.tiny import tiny_swiftkv_model

SWIFTKV = str(Path(sys.executable).parent / "swiftkv")
ENGINE = "{dtype: float32, enforce_eager: true, max_model_len: 512}"
ENV = json.dumps(CPU_ENV)  # JSON is YAML: one --set value


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    tiny_swiftkv_model("llama", num_hidden_layers=4, num_key_value_layers=2, hidden_size=128).save_pretrained(
        root / "swiftkv")
    copy_bundled_tokenizer(root / "swiftkv")
    return root


def _env() -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "VLLM_CACHE_ROOT": str(CACHE / "vllm")}


def test_calibrate_measures_and_writes_a_profile(models, tmp_path):
    """Two copies side by side (a placement group on the one local node, two engines measuring at once)."""
    out = tmp_path / "profile.json"
    run = subprocess.run(
        [SWIFTKV, "calibrate", "--model", f"tiny={models / 'swiftkv'}", "--set", f"models.0.engine_kwargs={ENGINE}",
         "--set", f"models.0.env={ENV}", "--input-lens", "64", "256", "--batches", "1", "2", "--num-prompts", "2",
         "--rounds", "1", "--side-by-side", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=_env(),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.read_text())["models"]["tiny"]
    assert figures["prefill_tokens_per_s"] == figures["prefill_tokens_per_s_by_input_len"]["256"] > 0
    assert set(figures["decode_step_s_by_batch"]) == {"1", "2"} and figures["prefill_skipping"] is True
    assert figures["side_by_side"] == 2 and "(2 side by side, medians)" in run.stdout
    assert "prefill_tokens_per_s: " in run.stdout and "CPU cores" in figures["hardware"]
    # The replica's engine limits (vLLM's server defaults on CPU), not the offline LLM class's 4,096 / 256.
    assert (figures["max_num_batched_tokens"], figures["max_num_seqs"]) == (2048, 128)
    assert not engine_processes()


def test_a_copy_that_fails_stops_the_others_at_once():
    """Side by side, a copy whose engine fails is the error at once; the copies waiting at the start
    line for it are cancelled, not left to time out."""
    import ray

    from serve_apps.calibrate import _all_or_first_error

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        def wait_at_the_start_line() -> None:
            time.sleep(300)

        def fail_to_start() -> None:
            raise RuntimeError("engine did not start")

        waits = ray.remote(wait_at_the_start_line).remote()
        fails = ray.remote(fail_to_start).remote()
        start = time.monotonic()
        with pytest.raises(ray.exceptions.RayTaskError, match="engine did not start"):
            _all_or_first_error([waits, fails])
        assert time.monotonic() - start < 60
        with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.WorkerCrashedError)):
            ray.get(waits, timeout=60)
    finally:
        ray.shutdown()


def test_side_by_side_figures_are_the_median_of_the_copies():
    from serve_apps.calibrate import median_of_copies

    runs = [{"model": "m", "prefill_skipping": True, "prefill_tokens_per_s": rate, "kv_cache_tokens": 4096,
             "decode_step_s_by_batch": {"1": step, "4": 2 * step}} for rate, step in [(100.0, 0.1), (80.0, 0.3),
                                                                                     (90.0, 0.2)]]
    assert median_of_copies(runs) == {"model": "m", "prefill_skipping": True, "prefill_tokens_per_s": 90.0,
                                      "kv_cache_tokens": 4096, "decode_step_s_by_batch": {"1": 0.2, "4": 0.4},
                                      "side_by_side": 3}


def test_load_test_job_compares_serve_with_vllm_alone_and_writes_its_figures(models, tmp_path):
    """The job end to end on its cheapest comparison (one replica and vLLM's own server): deploy,
    warm up, interleaved rounds with vLLM's client, report, plot, files. The other comparisons run
    the same steps on other deployments (their request mixes and replica sampling are checked below
    without a cluster; their figures are measured with the CPU recipe, docs/serving.md)."""
    out = tmp_path / "loadtest"
    overrides = {
        "scenarios": "[serve_overhead]", "swiftkv_model": str(models / "swiftkv"), "engine_kwargs": ENGINE,
        "env": ENV, "num_cpus": 0.25, "rounds": 2, "heavy_requests": 3, "heavy_input_len": 128,
        "heavy_concurrency": 2, "out": str(out),
    }
    run = subprocess.run(
        [sys.executable, "-m", "ray_jobs.loadtest", *[a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]],
        capture_output=True, text=True, timeout=1200, env=_env(), cwd=Path(__file__).resolve().parents[1],
    )
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    overhead = results["serve_overhead"]
    assert [list(r) for r in overhead["rounds"]] == [["serve", "vllm"], ["vllm", "serve"]]  # interleaved
    for row in overhead["rounds"]:
        for where in ("serve", "vllm"):
            assert row[where]["requests"] == 3 and row[where]["failed"] == 0 and row[where]["ttft_s"]["p50"] > 0
    assert overhead["throughput_ratio"] > 0 and overhead["ttft_p50_ratio"] > 0
    report = (out / "report.md").read_text()
    assert "Serve / vLLM alone: throughput" in report and "Failed requests over the whole run: 0" in report
    assert (out / "loadtest.png").read_bytes()[:4] == b"\x89PNG"
    assert not engine_processes()


def test_long_short_mix_and_per_class_summaries():
    from serve_apps.loadtest.traffic import long_short_mix, summarize

    mix = long_short_mix(20, 0.25, long_len=300, long_output_len=4, short_len=16, short_output_len=40, seed=3)
    assert sorted({(len(r.prompt), r.output_len) for r in mix}) == [(16, 40), (300, 4)]
    assert sum(len(r.prompt) == 300 for r in mix) == 5 and mix == long_short_mix(20, 0.25, 300, 4, 16, 40, seed=3)
    lens = [len(r.prompt) for r in mix]
    result = {"input_lens": lens, "ttfts": [n / 100 for n in lens], "itls": [[0.01, 0.03]] * 20,
              "errors": ["" if i else "boom" for i in range(20)], "request_throughput": 1.0,
              "total_token_throughput": 9.0, "duration": 20.0}
    long, short = summarize(result, min_input_len=300), summarize(result, max_input_len=16)
    assert long["requests"] + short["requests"] == 20 and long["ttft_s"]["p50"] == 3.0
    assert long["failed"] + short["failed"] == 1 and long["tpot_s"]["p50"] == pytest.approx(0.02)


def test_replica_sampler_measures_replica_seconds_and_the_scale_up():
    from serve_apps.loadtest.scenarios import ReplicaSampler

    sampler = ReplicaSampler("model-x")
    sampler.samples = [(10.0, "HEALTHY", 1), (12.0, "UPSCALING", 1), (14.0, "UPSCALING", 2), (20.0, "HEALTHY", 2),
                       (30.0, "HEALTHY", 1)]
    assert sampler.first_scale_up(10.5) == pytest.approx(1.5)
    assert sampler.replica_seconds(10.0, 30.0) == pytest.approx(1 * 2 + 1 * 2 + 2 * 6 + 2 * 10)
