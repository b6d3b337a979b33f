"""The application on an embedded local Ray, for a laptop (``swiftkv serve``).

Starts Ray and Serve on this machine, deploys the application, prints the URL when it is ready,
and on SIGTERM or Ctrl-C drains in-flight requests (Serve's graceful shutdown), stops Serve and Ray
and makes sure no process is left behind: this process becomes a child subreaper (Linux), so vLLM
engine-core and worker processes orphaned by a dying replica are re-parented to it, and whatever
is still running once Ray has stopped is terminated.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from serve_apps.config import AppConfig
from swiftkv.yaml_config import parse_config, read_yaml_mapping

log = logging.getLogger("swiftkv.serve")

APP_NAME = "swiftkv"
IMPORT_PATH = "serve_apps.app:build_app"
PR_SET_CHILD_SUBREAPER = 36
PROXY_TIMEOUT_MARGIN_S = 5.0


def read_app_config(path: str | Path | None, models: list[str], overrides: list[str]) -> AppConfig:
    """The application config from a Serve config file (the ``args`` of its swiftkv application) or
    a bare ``AppConfig`` YAML, with ``--model [NAME=]REF`` entries replacing its models (each takes
    the file's first model entry, or the CPU defaults, as its template) and ``--set`` overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        tree = read_yaml_mapping(path)
        if "applications" in tree:
            apps = [a for a in tree["applications"] or [] if a.get("import_path") == IMPORT_PATH]
            if not apps:
                raise ValueError(f"{path}: no application with import_path {IMPORT_PATH}")
            tree = apps[0].get("args") or {}
    if models:
        template = dict((tree.get("models") or [cpu_model_template()])[0])
        entries = []
        for item in models:
            name, sep, ref = item.partition("=")
            if not sep:
                name, ref = Path(item.rstrip("/")).name or item, item
            entries.append({**template, "name": name, "model": ref})
        tree["models"] = entries
    if not tree.get("models"):
        raise ValueError("no model to serve: give --model PATH (repeatable) or --config FILE")
    return parse_config(AppConfig, tree, overrides, what="serve config")


def cpu_model_template() -> dict[str, Any]:
    """Defaults for a model served on this machine without a config file."""
    import torch

    if torch.cuda.is_available():
        return {"num_gpus": 1}
    return {"env": {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}


def _become_subreaper() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def stop_leftovers(grace_s: float = 10.0) -> list[str]:
    """Terminate every process still descended from this one; return what was found."""
    children = psutil.Process().children(recursive=True)
    found = []
    for child in children:
        try:
            found.append(f"{child.pid} {' '.join(child.cmdline())[:80]}")
            child.terminate()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return found


class _Stop(Exception):
    """Raised in the main thread by the first SIGTERM/SIGINT."""


def _install_signal_handlers() -> None:
    def handler(signum, frame):
        # Later signals are ignored: the drain and shutdown below must not be cut short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise _Stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def check_exposure(config: AppConfig, host: str) -> None:
    """Fail closed: an endpoint other hosts can reach needs an API key or an explicit opt-out."""
    from serve_apps.auth import Auth, is_loopback

    auth = Auth.from_config(config)  # also refuses a key together with insecure_no_auth
    if not is_loopback(host) and auth.key is None and not auth.open_to_all:
        raise ValueError(f"--host {host} is reachable from other hosts and no API key is configured: set "
                         f"{config.api_key_env or 'the api_key_env variable'} (or api_key_file), or pass "
                         "--insecure-no-auth to serve without one")


def check_ray_auth(config: AppConfig) -> None:
    """Fail closed: Serve binds each replica's gRPC port on every interface, and only Ray's token
    authentication (on by default for a local Ray) keeps other hosts from calling it."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled" and not config.insecure_no_auth:
        raise ValueError("RAY_AUTH_MODE=disabled turns Ray's token authentication off, and Serve's replicas then take "
                         "unauthenticated calls from any host on their gRPC ports: unset it, or pass "
                         "--insecure-no-auth")


LOOPBACK_RAY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Ray's own services (GCS, raylet, agents, the metrics endpoint) on 127.0.0.1 only: Ray binds them to
the node address, which it takes to be loopback where multi-node clusters are off. Read when Ray is
first imported (vLLM imports it), by the endpoint's Ray and by any process that attaches to it."""


def _ray_environment() -> None:
    """Ray settings of the local cluster, as environment variables its processes inherit."""
    os.environ.update(LOOPBACK_RAY)
    # A replica Serve kills (a failed health check, a drain past its timeout) or that crashes leaves
    # its vLLM engine-core and worker processes behind, hung ones included: the raylet kills them.
    os.environ["RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper"] = "true"


def _check_ray_is_loopback() -> None:
    import ray

    from serve_apps.auth import is_loopback

    address = ray.util.get_node_ip_address()
    if not is_loopback(address):  # Ray was imported before _ray_environment: fail closed
        raise RuntimeError(f"the local Ray listens on {address}, not on loopback only")


def serve_locally(config: AppConfig, host: str, port: int, num_cpus: int | None, metrics_port: int) -> int:
    """Run until SIGTERM/Ctrl-C; return the exit code."""
    check_exposure(config, host)
    _ray_environment()
    from serve_apps.vllm_app import check_admission, served_engine_config
    from swiftkv.model_source import resolve_model

    for model in config.models:  # a bad reference or engine option is one clear error before anything starts
        check_admission(model, served_engine_config(model, resolve_model(model.model))[1])
    check_ray_auth(config)
    _become_subreaper()
    _install_signal_handlers()
    started = False
    try:
        import ray
        from ray import serve

        from serve_apps.app import build_app

        ray.init(address="local", num_cpus=num_cpus or max(8, os.cpu_count() or 1), include_dashboard=False,
                 _metrics_export_port=metrics_port, configure_logging=False)
        _install_signal_handlers()  # ray.init replaced them with its own
        started = True
        _check_ray_is_loopback()
        # Serve's own deadline is a backstop behind the ingress's, which answers in OpenAI's format first.
        serve.start(http_options={"host": host, "port": port,
                                  "request_timeout_s": config.request_timeout_s + PROXY_TIMEOUT_MARGIN_S})
        names = ", ".join(m.name for m in config.models)
        print(f"swiftkv serve: starting {names} (first start loads and warms up each engine)", flush=True)
        t0 = time.monotonic()
        try:
            serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as err:  # a deployment failed to start: Serve's message says which and why
            print(f"swiftkv serve: error: the application failed to start: {err}", file=sys.stderr, flush=True)
            return 1
        print(f"swiftkv serve: ready in {time.monotonic() - t0:.0f} s at http://{host}:{port}/v1 "
              f"(models: {names}; health: http://{host}:{port}/health/ready; "
              f"Prometheus metrics, this host only: http://127.0.0.1:{metrics_port}/metrics; "
              f"Ray at {ray.get_runtime_context().gcs_address})", flush=True)
        while True:
            time.sleep(3600)
    except _Stop as stop:
        print(f"swiftkv serve: {stop}: draining in-flight requests, then stopping", flush=True)
        return 0
    finally:
        try:
            if started:
                from ray import serve

                try:
                    # Deleting the application drains it: its replicas stop taking requests and finish
                    # the ones in flight (within graceful_shutdown_timeout_s) while the proxy still
                    # relays them. serve.shutdown() alone would stop the proxy first and cut open streams.
                    serve.delete(APP_NAME)
                    serve.shutdown()
                finally:
                    ray.shutdown()
        finally:  # even when Serve's own shutdown failed or timed out
            left = stop_leftovers()
            if left:
                log.warning("stopped %d leftover process(es): %s", len(left), "; ".join(left))
            print("swiftkv serve: stopped", flush=True)
