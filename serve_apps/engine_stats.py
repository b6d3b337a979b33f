"""The vLLM stat logger that feeds a replica's :class:`~serve_apps.load.LoadTracker`.

vLLM 0.32 calls ``record(scheduler_stats, iteration_stats)`` in the front-end process after every
engine step. ``SchedulerStats`` and ``IterationStats`` are not a stable vLLM interface (its own
docstring says so), so this file is the only place that reads them.
"""

from __future__ import annotations

import time
from functools import partial

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

from serve_apps.load import LoadTracker


class LoadStatLogger(StatLoggerBase):
    """Copies the figures the autoscaler and router need into a :class:`LoadTracker`."""

    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0, *, tracker: LoadTracker) -> None:
        self.tracker = tracker

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats=None,
        engine_idx: int = 0,
    ) -> None:
        if iteration_stats is not None:
            prompt = iteration_stats.prompt_token_stats  # prefills that finished in this step
            if prompt.total:
                self.tracker.on_prefill_done(prompt.total, prompt.computed)
            if iteration_stats.num_preempted_reqs:
                self.tracker.on_preempted(iteration_stats.num_preempted_reqs)
            if iteration_stats.finished_requests:
                self.tracker.on_finished(len(iteration_stats.finished_requests))
            if iteration_stats.time_to_first_tokens_iter:
                self.tracker.on_first_tokens(time.time(), list(iteration_stats.time_to_first_tokens_iter))
        if scheduler_stats is not None:
            self.tracker.on_step(time.monotonic())
            self.tracker.on_scheduler(
                scheduler_stats.num_running_reqs,
                scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
                scheduler_stats.kv_cache_usage,
            )

    def log_engine_initialized(self) -> None:
        pass


def load_logger_factory(tracker: LoadTracker):
    """A per-engine stat logger factory (``AsyncLLM(stat_loggers=[...])``) bound to ``tracker``."""
    return partial(LoadStatLogger, tracker=tracker)
