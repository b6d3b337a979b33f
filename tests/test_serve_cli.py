"""``swiftkv serve`` as a user runs it: the installed command starts a local Ray and the Serve
application, prints the URL when ready, and on SIGTERM drains the request in flight, stops Serve and
Ray and leaves no process behind."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import psutil
import pytest

from swiftkv.bundled import copy_bundled_tokenizer
from tests.serve_cluster import CACHE, CPU_ENV, engine_processes, free_port
from tests.tiny import tiny_swiftkv_model

SWIFTKV = str(Path(sys.executable).parent / "swiftkv")
STARTUP_S = 300
RAY_TOKEN_AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def test_serve_prints_its_url_drains_on_sigterm_and_leaves_nothing(tmp_path):
    model = tiny_swiftkv_model("llama", num_hidden_layers=4, num_key_value_layers=2, hidden_size=128)
    model.save_pretrained(tmp_path / "model")
    copy_bundled_tokenizer(tmp_path / "model")
    port, metrics_port = free_port(), free_port()
    log_path = tmp_path / "serve.log"
    env = {**os.environ, **RAY_TOKEN_AUTH, "VLLM_CACHE_ROOT": str(CACHE / "vllm")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [SWIFTKV, "serve", "--model", f"tiny={tmp_path / 'model'}", "--port", str(port),
             "--metrics-port", str(metrics_port), "--num-cpus", "4",
             "--set", "models.0.engine_kwargs={dtype: float32, enforce_eager: true, max_model_len: 512}",
             "--set", f"models.0.env={json.dumps(CPU_ENV)}"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    descendants: set[int] = set()
    try:
        deadline = time.monotonic() + STARTUP_S
        while "swiftkv serve: ready" not in log_path.read_text():
            assert proc.poll() is None, f"swiftkv serve exited early:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready after {STARTUP_S} s:\n{log_path.read_text()[-3000:]}"
            time.sleep(1)
        assert f"http://127.0.0.1:{port}/v1" in log_path.read_text()
        descendants = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert any("VLLM::EngineCore" in p.name() for p in map(psutil.Process, descendants) if p.is_running())

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        first_chunk, chunks, errors = threading.Event(), [], []

        def stream():
            try:
                for chunk in client.completions.create(model="tiny", prompt="hello", max_tokens=300, stream=True,
                                                       temperature=0.0, extra_body={"ignore_eos": True},
                                                       stream_options={"include_usage": True}):
                    chunks.append(chunk)
                    first_chunk.set()
            except Exception as err:  # recorded: the drain must not cut the stream
                errors.append(err)
                first_chunk.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(60)
        proc.send_signal(signal.SIGTERM)
        reader.join(120)
        # The request in flight finished: all 300 tokens (vLLM may merge a slow reader's deltas into one
        # chunk, so tokens are counted from the usage chunk, not chunks) and a "length" finish.
        assert not errors, errors
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 300, chunks[-1]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert proc.wait(120) == 0
        out = log_path.read_text()
        assert "SIGTERM: draining in-flight requests" in out and "swiftkv serve: stopped" in out
        time.sleep(1)
        alive = [pid for pid in descendants if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        assert not alive, f"left running: {[psutil.Process(p).name() for p in alive]}"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in descendants:
            if psutil.pid_exists(pid):
                psutil.Process(pid).kill()


@pytest.mark.parametrize(("args", "message"), [
    ([], "no model to serve"),
    (["--config", "nope.yaml"], "config file not found: nope.yaml"),
    (["--model", "m=/nonexistent/model"], "model folder /nonexistent/model does not exist"),
    (["--model", "m=bundled", "--set", "models.0.engine_kwargs.max_model_lenn=512"], "max_model_lenn"),
    (["--model", "m=bundled", "--set", "models.0.autoscaling.max_replicas=0"], "max_replicas"),
    (["--model", "m=bundled", "--set", "models.0.engine_kwargs.max_model_len=100000"], "max_model_len"),
])
def test_bad_serve_arguments_are_one_line(args, message, capsys):
    """Checked before anything starts (in-process: the installed command is the test above's)."""
    import ray

    from swiftkv.cli import main

    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not ray.is_initialized()


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--host", "0.0.0.0"], {}, "--host 0.0.0.0 is reachable from other hosts and no API key is configured: set "
                                "SWIFTKV_API_KEY (or api_key_file), or pass --insecure-no-auth"),
    (["--insecure-no-auth"], {"SWIFTKV_API_KEY": "k"}, "insecure_no_auth is set but an API key is configured too"),
    (["--set", "models.0.max_ongoing_requests=128"], {}, "must be below the engine's max_num_seqs (128)"),
    ([], {"RAY_AUTH_MODE": "disabled"}, "RAY_AUTH_MODE=disabled turns Ray's token authentication off"),
])
def test_serve_fails_closed(args, env, message, capsys, monkeypatch):
    """An endpoint others can reach needs a key, Ray keeps its token auth, vLLM holds no queue of its
    own: each refused before anything starts, unless --insecure-no-auth says so on purpose."""
    import ray

    from swiftkv.cli import main

    monkeypatch.delenv("SWIFTKV_API_KEY", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--model", "m=bundled", *args]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # (vLLM may log above it)
    assert last.startswith("swiftkv serve: error: ") and message in last
    assert not ray.is_initialized()


def test_a_deployment_that_cannot_start_is_an_error_naming_it(tmp_path):
    """A replica that cannot load its model (weights cut short: the config the CLI checks up front is
    fine) fails the start after Serve's retry: exit 1, the deployment and the reason named, nothing left.
    (An engine option vLLM refuses, such as a max_model_len over the model's, is refused before
    anything starts: the CLI builds each engine's config first.)"""
    model = tiny_swiftkv_model("llama", num_hidden_layers=4, num_key_value_layers=2, hidden_size=128)
    model.save_pretrained(tmp_path / "model")
    copy_bundled_tokenizer(tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    env = {**os.environ, **RAY_TOKEN_AUTH, "VLLM_CACHE_ROOT": str(CACHE / "vllm")}
    proc = subprocess.Popen(
        [SWIFTKV, "serve", "--model", f"tiny={tmp_path / 'model'}", "--port", str(free_port()),
         "--metrics-port", str(free_port()), "--num-cpus", "4",
         "--set", "models.0.engine_kwargs={dtype: float32, enforce_eager: true, max_model_len: 512}",
         "--set", f"models.0.env={json.dumps(CPU_ENV)}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        out, _ = proc.communicate(timeout=STARTUP_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    assert "swiftkv serve: error: the application failed to start" in out and "model-tiny" in out
    assert "safetensors" in out.lower() and "swiftkv serve: stopped" in out
    assert not engine_processes()
