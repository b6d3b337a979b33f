"""The load test's comparisons, each run side by side: the variants take turns within every round
(the order alternating between rounds), every round with fresh prompts.

- ``swiftkv_vs_base``: base and SwiftKV deployments (one replica each) on prefill-heavy traffic;
- ``serve_overhead``: the same SwiftKV deployment vs vLLM's own OpenAI server alone, same engine options;
- ``router``: two deployments of the SwiftKV model (2 replicas each by default), prefill-aware
  router vs Serve's power-of-two router, on the same Poisson mix of long and short prompts;
- ``autoscaling``: two 1-to-2-replica deployments, prefill-aware policy vs Serve's request-count
  policy, each hit by the same burst of long prompts: seconds to the scale-up decision,
  replica-seconds over a fixed window, TTFT.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from serve_apps.app import build_app, deployment_name
from serve_apps.loadtest.config import LoadTestConfig
from serve_apps.loadtest.traffic import long_short_mix, send, summarize, uniform

log = logging.getLogger("swiftkv.loadtest")

APP = "swiftkv-loadtest"
ROUTE = "/loadtest"
HOLDING = ("STARTING", "UPDATING", "RECOVERING", "RUNNING", "STOPPING")  # replica states that hold resources
ONE_REPLICA = {"autoscaling": {"min_replicas": 1, "max_replicas": 1}}


def paired_ratio(rounds: list[dict], key, a: str, b: str) -> float:
    """Median over rounds of ``key(a) / key(b)`` within each round."""
    return statistics.median(key(r[a]) / key(r[b]) for r in rounds)


class Session:
    """Deploys the load test's application on the running Serve and removes it afterwards."""

    def __init__(self, cfg: LoadTestConfig) -> None:
        self.cfg = cfg
        self.url = f"http://127.0.0.1:{cfg.port}{ROUTE}"
        self.deployed: list[str] = []  # model names of the application now running

    def model(self, name: str, model: str, capacity: float, **options: Any) -> dict[str, Any]:
        cfg = self.cfg
        return {"name": name, "model": model, "prefill_tokens_per_s": capacity, "engine_kwargs": cfg.engine_kwargs,
                "env": cfg.env, "num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus,
                "graceful_shutdown_timeout_s": 30, **options}

    def deploy(self, models: list[dict[str, Any]]) -> str:
        from ray import serve

        log.info("deploying %s", ", ".join(m["name"] for m in models))
        serve.run(build_app({"models": models}), name=APP, route_prefix=ROUTE, blocking=False)
        self.deployed = [m["name"] for m in models]
        return self.url

    def remove(self) -> None:
        from ray import serve

        serve.delete(APP)


def _replicas(status, deployment: str) -> tuple[str, int]:
    entry = status.applications[APP].deployments[deployment]
    return str(entry.status), sum(entry.replica_states.get(s, 0) for s in HOLDING)


class ReplicaSampler:
    """Samples a deployment's status and replica count from Serve every ``period_s``."""

    def __init__(self, deployment: str, period_s: float = 0.25) -> None:
        self.deployment, self.period_s = deployment, period_s
        self.samples: list[tuple[float, str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from ray import serve

        while not self._stop.is_set():
            status, count = _replicas(serve.status(), self.deployment)
            self.samples.append((time.monotonic(), status, count))
            self._stop.wait(self.period_s)

    def __enter__(self) -> ReplicaSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def replica_seconds(self, start: float, end: float) -> float:
        total = 0.0
        points = [(t, n) for t, _, n in self.samples if start <= t <= end]
        for (t0, n0), (t1, _) in zip(points, points[1:], strict=False):
            total += n0 * (t1 - t0)
        return total

    def first_scale_up(self, start: float) -> float | None:
        """Seconds from ``start`` to the first sample where Serve was adding replicas."""
        for t, status, count in self.samples:
            if t >= start and (count > 1 or "UPSCALING" in status):
                return t - start
        return None


def _wait_settled(deployment: str, replicas: int, timeout_s: float = 300.0) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        entry = serve.status().applications[APP].deployments[deployment]
        if dict(entry.replica_states) == {"RUNNING": replicas}:
            return
        time.sleep(1.0)
    raise TimeoutError(f"{deployment} did not settle at {replicas} replica(s) within {timeout_s:.0f} s")


def warm_up(url: str, names: list[str], tokenizer, lengths: list[int], per_length: int) -> None:
    """Untimed requests of every prompt length each run will use, so first-use costs of new shapes
    (CPU kernel selection, allocator growth) land in no figure; several at once, so that every
    replica of a deployment gets some."""
    for name in names:
        for i, length in enumerate(lengths):
            send(url, name, tokenizer, uniform(per_length, length, 2, seed=-1000 - 10 * i), concurrency=per_length)


def interleaved(cfg: LoadTestConfig, label: str, names: list[str], measure: Callable[[str, int], dict],
                brief: Callable[[dict], Any]) -> list[dict]:
    """``cfg.rounds`` rounds of ``measure(variant, round)`` for every variant, the order alternating
    between rounds (so neither variant always runs first, on a warmer or a colder machine)."""
    rounds = []
    for r in range(cfg.rounds):
        rounds.append({name: measure(name, r) for name in (names if r % 2 == 0 else names[::-1])})
        log.info("%s round %d: %s", label, r, {k: brief(v) for k, v in rounds[-1].items()})
    return rounds


def _throughput(summary: dict) -> float:
    return round(summary["request_throughput"], 3)


def heavy(cfg: LoadTestConfig, round_: int, salt: int):
    return uniform(cfg.heavy_requests, cfg.heavy_input_len, cfg.heavy_output_len, cfg.seed * 10_000 + salt + round_)


def swiftkv_vs_base(cfg: LoadTestConfig, session: Session, tokenizer) -> dict[str, Any]:
    url = session.deploy([session.model("base", cfg.base_model, cfg.base_prefill_tokens_per_s, **ONE_REPLICA),
                          session.model("swiftkv", cfg.swiftkv_model, cfg.swiftkv_prefill_tokens_per_s, **ONE_REPLICA)])
    warm_up(url, ["base", "swiftkv"], tokenizer, [cfg.heavy_input_len], cfg.heavy_concurrency)
    rounds = interleaved(cfg, "swiftkv_vs_base", ["base", "swiftkv"], lambda name, r: summarize(
        send(url, name, tokenizer, heavy(cfg, r, salt=0), concurrency=cfg.heavy_concurrency)), _throughput)
    return {
        "rounds": rounds,
        "throughput_ratio": paired_ratio(rounds, lambda s: s["request_throughput"], "swiftkv", "base"),
        "ttft_p50_ratio": paired_ratio(rounds, lambda s: s["ttft_s"]["p50"], "swiftkv", "base"),
        "tpot_p50_ratio": paired_ratio(rounds, lambda s: s["tpot_s"]["p50"], "swiftkv", "base"),
    }


def vllm_flags(engine_kwargs: dict[str, Any]) -> list[str]:
    """``engine_kwargs`` as ``vllm serve`` flags (``--no-x`` for a false boolean)."""
    import json

    flags = []
    for key, value in engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flags


@contextmanager
def standalone_vllm(cfg: LoadTestConfig, name: str) -> Iterator[str]:
    """vLLM's own OpenAI server on 127.0.0.1 for the SwiftKV model, the replicas' engine options."""
    from swiftkv.model_source import resolve_model

    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", resolve_model(cfg.swiftkv_model),
               "--served-model-name", name, "--host", "127.0.0.1", "--port", str(cfg.vllm_port),
               *vllm_flags(cfg.engine_kwargs)]
    log.info("starting vLLM's own server: %s", " ".join(command))
    output = tempfile.TemporaryFile()
    proc = subprocess.Popen(command, env={**os.environ, **cfg.env}, start_new_session=True,
                            stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{cfg.vllm_port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                output.seek(0)
                tail = output.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"vLLM's server exited with {proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("vLLM's server was not healthy within 600 s") from None
                time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):  # its engine-core process is in its process group
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        output.close()


def serve_overhead(cfg: LoadTestConfig, session: Session, tokenizer) -> dict[str, Any]:
    if "swiftkv" not in session.deployed:  # swiftkv_vs_base may have left the same deployment up
        session.deploy([session.model("swiftkv", cfg.swiftkv_model, cfg.swiftkv_prefill_tokens_per_s, **ONE_REPLICA)])
    urls = {"serve": session.url}
    with standalone_vllm(cfg, "swiftkv") as urls["vllm"]:
        for where in urls:
            warm_up(urls[where], ["swiftkv"], tokenizer, [cfg.heavy_input_len], cfg.heavy_concurrency)
        rounds = interleaved(cfg, "serve_overhead", ["serve", "vllm"], lambda where, r: summarize(
            send(urls[where], "swiftkv", tokenizer, heavy(cfg, r, salt=100), concurrency=cfg.heavy_concurrency)),
            _throughput)
    return {
        "rounds": rounds,
        "throughput_ratio": paired_ratio(rounds, lambda s: s["request_throughput"], "serve", "vllm"),
        "ttft_p50_ratio": paired_ratio(rounds, lambda s: s["ttft_s"]["p50"], "serve", "vllm"),
    }


def router(cfg: LoadTestConfig, session: Session, tokenizer) -> dict[str, Any]:
    fixed = {"autoscaling": {"min_replicas": cfg.router_replicas, "max_replicas": cfg.router_replicas}}
    url = session.deploy([
        session.model("mix-prefill", cfg.swiftkv_model, cfg.swiftkv_prefill_tokens_per_s, **fixed),
        session.model("mix-pow2", cfg.swiftkv_model, cfg.swiftkv_prefill_tokens_per_s, routing={"router": "pow2"},
                      **fixed),
    ])
    warm_up(url, ["mix-prefill", "mix-pow2"], tokenizer, [cfg.mix_long_len, cfg.mix_short_len], 4)

    def measure(name: str, r: int) -> dict[str, Any]:
        requests = long_short_mix(cfg.mix_requests, cfg.mix_long_share, cfg.mix_long_len, cfg.mix_long_output_len,
                                  cfg.mix_short_len, cfg.mix_short_output_len, cfg.seed * 10_000 + 200 + r)
        result = send(url, name, tokenizer, requests, rate=cfg.mix_rate, seed=cfg.seed + r)
        return {"all": summarize(result), "short": summarize(result, max_input_len=cfg.mix_short_len),
                "long": summarize(result, min_input_len=cfg.mix_long_len)}

    rounds = interleaved(cfg, "router (short TTFT p95)", ["mix-prefill", "mix-pow2"], measure,
                         lambda v: round(v["short"]["ttft_s"]["p95"], 3))
    return {
        "rounds": rounds,
        "short_ttft_p95_ratio": paired_ratio(rounds, lambda s: s["short"]["ttft_s"]["p95"], "mix-prefill", "mix-pow2"),
        "long_ttft_p95_ratio": paired_ratio(rounds, lambda s: s["long"]["ttft_s"]["p95"], "mix-prefill", "mix-pow2"),
        "throughput_ratio": paired_ratio(rounds, lambda s: s["all"]["request_throughput"], "mix-prefill", "mix-pow2"),
    }


def autoscaling(cfg: LoadTestConfig, session: Session, tokenizer) -> dict[str, Any]:
    scaling = {"min_replicas": 1, "max_replicas": 2, "ttft_budget_s": cfg.ttft_budget_s}
    url = session.deploy([
        session.model("burst-prefill", cfg.swiftkv_model, cfg.swiftkv_prefill_tokens_per_s, autoscaling=scaling),
        session.model("burst-requests", cfg.swiftkv_model, cfg.swiftkv_prefill_tokens_per_s, routing={"router": "pow2"},
                      autoscaling={**scaling, "policy": "requests", "target_ongoing_requests": cfg.requests_target}),
    ])
    warm_up(url, ["burst-prefill", "burst-requests"], tokenizer, [cfg.burst_input_len], 2)

    def measure(name: str, r: int) -> dict[str, Any]:
        burst = uniform(cfg.burst_requests, cfg.burst_input_len, cfg.burst_output_len, cfg.seed * 10_000 + 300 + r)
        deployment = deployment_name(name)
        _wait_settled(deployment, 1)
        with ReplicaSampler(deployment) as sampler:
            start = time.monotonic()
            result = send(url, name, tokenizer, burst)
            time.sleep(max(0.0, start + cfg.burst_window_s - time.monotonic()))
        summary = summarize(result)
        return {
            **summary,
            "scale_up_decision_s": sampler.first_scale_up(start),
            "replica_seconds": sampler.replica_seconds(start, start + cfg.burst_window_s),
            "max_replicas": max(n for _, _, n in sampler.samples),
            "ttft_p95_within_budget": summary["ttft_s"]["p95"] <= cfg.ttft_budget_s,
            "replicas_over_time": [(round(t - start, 2), n) for t, _, n in sampler.samples],
        }

    rounds = interleaved(cfg, "autoscaling (scale-up s, replica-s)", ["burst-prefill", "burst-requests"], measure,
                         lambda v: (v["scale_up_decision_s"], round(v["replica_seconds"], 1)))
    return {"rounds": rounds, "window_s": cfg.burst_window_s, "ttft_budget_s": cfg.ttft_budget_s,
            "requests_target": cfg.requests_target}


SCENARIOS = {"swiftkv_vs_base": swiftkv_vs_base, "serve_overhead": serve_overhead, "router": router,
             "autoscaling": autoscaling}


def run_loadtest(cfg: LoadTestConfig) -> dict[str, Any]:
    """Run the configured comparisons on the connected Ray cluster's Serve (started on 127.0.0.1 if
    it is not running) and return every figure."""
    from ray import serve
    from transformers import AutoTokenizer

    from swiftkv.model_source import resolve_model

    serve.start(http_options={"host": "127.0.0.1", "port": cfg.port})
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(cfg.swiftkv_model))
    session = Session(cfg)
    results: dict[str, Any] = {"config": cfg.model_dump()}
    try:
        for scenario in cfg.scenarios:
            log.info("scenario %s", scenario)
            started = time.monotonic()
            results[scenario] = SCENARIOS[scenario](cfg, session, tokenizer)
            results[scenario]["wall_s"] = time.monotonic() - started
    finally:
        session.remove()
    return results
