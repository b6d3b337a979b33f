"""Stopping an offline ``vllm.LLM`` when its work is done, not when it is garbage-collected.

vLLM 0.32's ``LLM`` has no ``close()``: its engine-core process (and that process's workers) stop
when the engine client shuts down, which signals the process and returns before it has exited.
Code that runs an engine inside a long-lived process (a Ray worker, a test session) calls
:func:`shutdown_llm` so that nothing outlives the work.
"""

from __future__ import annotations

import multiprocessing
import time


def shutdown_llm(llm, timeout_s: float = 30.0) -> None:
    """Stop ``llm``'s engine-core process and wait (at most ``timeout_s``) until it is gone."""
    llm.llm_engine.engine_core.shutdown()
    deadline = time.monotonic() + timeout_s
    # active_children() joins the children that have exited and lists the rest.
    while any(p.name.startswith("EngineCore") for p in multiprocessing.active_children()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM's engine-core process did not exit within {timeout_s:.0f} s")
        time.sleep(0.1)
