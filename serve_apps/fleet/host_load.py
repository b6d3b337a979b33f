"""Who had the host's CPUs while a measurement ran: this process and its descendants (for the
validation: the replay client, ``swiftkv serve``, its Ray and every replica), the host's other
processes, and the hypervisor (steal: time a virtual CPU was ready but not run).

A replay on a shared machine measures the endpoint and whatever else ran beside it; recording the
split second by second lets a reader tell a slow stretch of the machine from a wrong model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import psutil

# Fields of psutil.cpu_times() that are not busy time; guest time is already inside user time.
_NOT_BUSY = ("idle", "iowait", "steal", "guest", "guest_nice")
# vLLM titles its engine-side processes "VLLM::EngineCore" (the scheduler) and "VLLM::Worker..." (the
# model's steps; on CPU too, its multiprocessing executor runs them apart from the engine core).
ENGINE_PROCESS = "VLLM::"
# A period with less idle than this (cores) had the host saturated.
SATURATED_IDLE = 0.2


@dataclass(frozen=True)
class HostSample:
    """One period, in cores (CPU-seconds per second) of the host."""

    t: float
    """Seconds from the start of the recording to the end of the period."""
    ours: float
    """This process and its descendants."""
    engines: float
    """The part of ``ours`` in vLLM's engine processes (engine core and model workers)."""
    others: float
    """Every other process of the host (busy time not ours)."""
    steal: float
    """Taken by the hypervisor for other guests (0 on bare metal)."""
    idle: float
    """Not used."""


class HostLoad:
    """A context manager that samples the host's CPU split every ``period_s`` on a thread."""

    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self.samples: list[HostSample] = []
        self.started = 0.0  # the wall clock on entering; the samples' ``t`` count from it
        self._stop = threading.Event()
        self._me = psutil.Process()
        self._cpu: dict[tuple[int, float], float] = {}

    def _our_cpu_s(self, since: float) -> tuple[float, float]:
        """CPU seconds our process tree used since the last call, and the engines' part of them (a
        process born after ``since`` counts from its start; one first seen older, from now)."""
        used = engines = 0.0
        seen: dict[tuple[int, float], float] = {}
        for proc in [self._me, *self._me.children(recursive=True)]:
            try:
                key = (proc.pid, proc.create_time())
                times = proc.cpu_times()
                engine = ENGINE_PROCESS in " ".join(proc.cmdline())
            except psutil.Error:  # gone between the listing and the read
                continue
            total = times.user + times.system
            seen[key] = total
            delta = total - self._cpu[key] if key in self._cpu else total if key[1] >= since else 0.0
            used += delta
            engines += delta if engine else 0.0
        self._cpu = seen
        return used, engines

    @staticmethod
    def _host() -> dict[str, float]:
        times = psutil.cpu_times()._asdict()
        return {"busy": sum(v for k, v in times.items() if k not in _NOT_BUSY),
                "steal": times.get("steal", 0.0), "idle": times["idle"] + times.get("iowait", 0.0)}

    def _run(self) -> None:
        start = last_t = self.started
        host = self._host()
        self._our_cpu_s(last_t)
        while not self._stop.wait(self.period_s):
            now, now_host = time.time(), self._host()
            dt = now - last_t
            ours, engines = (cpu_s / dt for cpu_s in self._our_cpu_s(last_t))
            busy = (now_host["busy"] - host["busy"]) / dt
            self.samples.append(HostSample(
                t=now - start, ours=ours, engines=engines, others=max(0.0, busy - ours),
                steal=(now_host["steal"] - host["steal"]) / dt, idle=(now_host["idle"] - host["idle"]) / dt))
            last_t, host = now, now_host

    def __enter__(self) -> HostLoad:
        self.started = time.time()
        self._thread = threading.Thread(target=self._run, name="host-load", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, between_unix: tuple[float, float] | None = None,
                excluding_unix: Sequence[tuple[float, float]] = ()) -> dict[str, float]:
        """Mean cores of each kind over the recording (or the periods that ended within
        ``between_unix``, wall-clock seconds, and overlapping none of ``excluding_unix``); the highest mean over
        any 10 s of the others plus steal (a slow stretch hides in a mean); and, over the periods that
        left no core idle, how the cores were shared (what the engines got when they had to share)."""
        samples = self.samples
        if between_unix is not None:
            start, end = (u - self.started for u in between_unix)
            samples = [s for s in samples if start < s.t <= end]
        for start, end in ((a - self.started, b - self.started) for a, b in excluding_unix):
            samples = [s for s in samples if not start < s.t < end + self.period_s]  # any overlap
        if not samples:
            return {}
        kinds = ("ours", "engines", "others", "steal", "idle")

        def mean(samples: list[HostSample]) -> dict[str, float]:
            return {k: sum(getattr(s, k) for s in samples) / len(samples) for k in kinds} if samples else {}

        taken = [s.others + s.steal for s in samples]
        span = max(1, min(round(10.0 / self.period_s), len(taken)))
        worst = max(sum(taken[i:i + span]) / span for i in range(len(taken) - span + 1))
        saturated = [s for s in samples if s.idle < SATURATED_IDLE]
        return {**mean(samples), "others_plus_steal_worst_10_s": worst,
                "saturated_periods": len(saturated),
                **{f"{k}_when_saturated": v for k, v in mean(saturated).items()}}

    def to_json(self) -> dict[str, object]:
        return {"period_s": self.period_s, "cores": psutil.cpu_count(), "summary": self.summary(),
                "samples": [asdict(s) for s in self.samples]}
