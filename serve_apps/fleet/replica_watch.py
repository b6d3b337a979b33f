"""The real deployment's replicas over time, for the validation of an autoscaled fleet: Serve's own
replica counts (``serve.status()``), polled from a driver attached to the endpoint's Ray cluster, and
what they say (when the fleet grew and shrank, how long a replica took to start, replica-seconds),
computed alike for the simulator's timeline so the two compare figure by figure."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from serve_apps.local import LOOPBACK_RAY


@dataclass(frozen=True)
class ReplicaSample:
    t: float
    """Seconds since the watch started."""

    running: int
    """Replicas serving (Serve's RUNNING)."""

    starting: int
    """Replicas asked for and not serving yet (Serve's STARTING, PENDING_ALLOCATION...)."""


class ReplicaWatch:
    """Polls one deployment's replica states every ``period_s`` in a thread while the block runs, as
    a driver of the endpoint's Ray cluster at ``address`` (``swiftkv serve`` prints it when ready)."""

    def __init__(self, address: str, app: str, deployment: str, period_s: float = 1.0) -> None:
        if not address:
            raise ValueError("no Ray address to watch the deployment's replicas through")
        if any(os.environ.get(key) != value for key, value in LOOPBACK_RAY.items()):
            # Without it this process's Ray resolves the loopback address to the host's and the attach
            # times out after minutes; say why at once instead.
            setting = " ".join(f"{key}={value}" for key, value in LOOPBACK_RAY.items())
            raise RuntimeError(f"the endpoint's Ray listens on loopback only: set {setting} before Ray is first "
                               "imported (`swiftkv fleet validate` does) to watch it")
        self.address, self.app, self.deployment, self.period_s = address, app, deployment, period_s
        self.samples: list[ReplicaSample] = []
        self.started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def counts(self) -> tuple[int, int]:
        """(running, starting) now."""
        from ray import serve

        states = {str(getattr(k, "value", k)): v for k, v in
                  serve.status().applications[self.app].deployments[self.deployment].replica_states.items()}
        running = states.get("RUNNING", 0)
        stopping = states.get("STOPPING", 0)
        return running, sum(states.values()) - running - stopping

    def __enter__(self) -> ReplicaWatch:
        import ray

        ray.init(address=self.address, logging_level="ERROR", configure_logging=False)
        self.started = time.time()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            running, starting = self.counts()
            self.samples.append(ReplicaSample(time.time() - self.started, running, starting))
            self._stop.wait(self.period_s)

    def wait_for_running(self, replicas: int, timeout_s: float) -> float:
        """Block until exactly ``replicas`` run and none starts (a scale-down after a burst); the
        seconds it took. Bounded: a fleet that never gets there is an error naming the count."""
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            if self.counts() == (replicas, 0):
                return time.monotonic() - began
            time.sleep(self.period_s)
        raise TimeoutError(f"the deployment did not reach {replicas} replicas within {timeout_s:.0f} s "
                           f"(now {self.counts()[0]} running)")

    def starting_unix(self) -> list[tuple[float, float]]:
        """Wall-clock spans in which a replica was starting (from the poll before the first that saw
        it to the first that saw none)."""
        spans, began, last = [], None, 0.0
        for s in self.samples:
            if s.starting and began is None:
                began = last
            elif not s.starting and began is not None:
                spans.append((self.started + began, self.started + s.t))
                began = None
            last = s.t
        if began is not None:
            spans.append((self.started + began, self.started + last))
        return spans

    def __exit__(self, *exc: object) -> None:
        import ray

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        ray.shutdown()  # detaches this driver; the endpoint's cluster keeps running


def startup_times(samples: list[ReplicaSample]) -> list[float]:
    """Seconds each scale-up took from the replica being asked for (``starting`` rising) to it
    serving (``running`` rising), from a watch's samples (one poll period of error either way)."""
    times, asked = [], []
    for before, now in zip(samples, samples[1:], strict=False):
        asked += [now.t] * max(0, now.starting - before.starting)
        for _ in range(max(0, now.running - before.running)):
            if asked:
                times.append(now.t - asked.pop(0))
    return times


def replica_figures(series: list[tuple[float, int]], horizon_s: float) -> dict[str, Any]:
    """What a fleet's serving-replica count over time says, up to ``horizon_s``: replica-seconds,
    the most replicas, when it first reached them and when it first came back below afterwards
    (None if never). ``series``: (seconds, running replicas) in time order, a step function."""
    steps = [(t, n) for t, n in series if t <= horizon_s]
    if not steps:
        return {"replica_seconds": 0.0, "peak": 0, "peak_at_s": None, "back_down_at_s": None}
    ends = [t for t, _ in steps[1:]] + [horizon_s]
    peak = max(n for _, n in steps)
    peak_at = next(t for t, n in steps if n == peak)
    back = next((t for t, n in steps if t > peak_at and n < peak), None)
    return {"replica_seconds": sum(n * (end - t) for (t, n), end in zip(steps, ends, strict=True)),
            "peak": peak, "peak_at_s": peak_at, "back_down_at_s": back}
