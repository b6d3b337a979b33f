"""``swiftkv serve`` as a child process: start it, wait (bounded) for its URL, stop it with SIGTERM
as a user would (it drains, stops Serve and Ray and leaves nothing), for jobs that show the service."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

SWIFTKV = str(Path(sys.executable).parent / "swiftkv")
READY = "swiftkv serve: ready in "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``with ServeProcess(args, log_path) as server: server.base_url`` (``args`` after ``swiftkv serve``;
    ``--port`` and ``--metrics-port`` are chosen free on 127.0.0.1; its Ray runs with token
    authentication and a fresh token; ``env`` is added to this process's environment)."""

    def __init__(self, args: list[str], log_path: Path, startup_s: float = 600, stop_s: float = 180,
                 env: dict[str, str] | None = None):
        self.args, self.log_path, self.startup_s, self.stop_s = args, log_path, startup_s, stop_s
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), **(env or {})}
        self.port = free_port()
        self.metrics_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.ready_s: float | None = None
        self.exit_code: int | None = None

    def __enter__(self) -> ServeProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [SWIFTKV, "serve", *self.args, "--host", "127.0.0.1", "--port", str(self.port),
                 "--metrics-port", str(self.metrics_port)],
                stdout=log, stderr=subprocess.STDOUT, env=self.env,
            )
        started, deadline = time.monotonic(), time.monotonic() + self.startup_s
        try:
            while READY not in (text := self.log_path.read_text()):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"swiftkv serve exited with {self.proc.returncode}:\n{text[-3000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"swiftkv serve not ready after {self.startup_s:.0f} s:\n{text[-3000:]}")
                time.sleep(1)
        except BaseException:
            self._stop()
            raise
        self.ready_s = time.monotonic() - started
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_s)
            except subprocess.TimeoutExpired:  # it had its chance to drain: never leave it running
                # Its descendants (Ray, replicas, vLLM engines) too: killed, it could not stop them.
                family = psutil.Process(self.proc.pid).children(recursive=True)
                self.proc.kill()
                self.proc.wait(30)
                for child in family:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.kill()
                psutil.wait_procs(family, timeout=30)
        self.exit_code = self.proc.returncode
