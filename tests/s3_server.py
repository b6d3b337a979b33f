"""A real S3 server for tests: moto's server in its own process on 127.0.0.1.

Its own process, not ``ThreadedMotoServer``: importing Flask into the test process breaks vLLM's CPU
engine start-up later in the same session (vLLM 0.32 scans every module's globals with ``hasattr``,
which raises on Flask's unbound request proxies)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def s3_env(endpoint: str) -> Iterator[None]:
    """Point boto3, s3fs and pyarrow at that server (endpoint and dummy credentials in the
    environment, restored on exit). s3fs keeps one filesystem per process, endpoint included, so
    its cache is cleared on entry and exit: another module's server may have been the last one."""
    import s3fs

    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def moto_s3_server(start_timeout_s: float = 60.0) -> Iterator[str]:
    """Yield the endpoint URL of a fresh moto server; stop it on exit."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:  # bounded by the deadline
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"moto server exited with code {proc.returncode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no moto server on 127.0.0.1:{port} after {start_timeout_s}s") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
