"""The endpoint's front end (HTTP proxy, ingress, routing, the first token's way back) measured
through a running ``swiftkv serve``, as the two fleet settings the simulator models it by:

- ``ingress_s``, its time per request, one request at a time: ``replicas`` equal prompts are sent
  together while every replica is idle (and the router's figures are settled); the router gives
  each its own replica, so they would get their first tokens together were the front end parallel.
  Each next one comes later by the time the front end spent on the one before (its whole spread
  over ``replicas - 1``);
- ``ingress_latency_s``, the rest of a lone request's way: short prompts sent one at a time, their
  TTFT minus the engine's own time for the prompt (the profile's idle TTFT) minus ``ingress_s``.
"""

from __future__ import annotations

import statistics
import time

from serve_apps.fleet.config import FrontEndCalibration
from serve_apps.fleet.profile import ReplicaCosts
from serve_apps.fleet.replay import Burst


def measure_front_end(burst: Burst, replicas: int, costs: ReplicaCosts, cal: FrontEndCalibration) -> dict[str, float]:
    """``{"ingress_s": ..., "ingress_latency_s": ...}`` (medians of ``cal.rounds``); with one replica
    the serialised share cannot be told apart and all of it counts as latency."""
    lone = statistics.median(burst.send(1, cal.lone_prompt_tokens, 1)[0]["ttft_s"] for _ in range(cal.rounds))
    per_request = 0.0
    if replicas > 1:
        spreads = []
        for _ in range(cal.rounds):
            time.sleep(cal.pause_s)
            firsts = sorted(r["sent_s"] + r["ttft_s"] for r in burst.send(replicas, cal.pair_prompt_tokens, 1))
            spreads.append((firsts[-1] - firsts[0]) / (replicas - 1))
        per_request = statistics.median(spreads)
    path = lone - costs.idle_ttft_s(cal.lone_prompt_tokens)
    return {"ingress_s": per_request, "ingress_latency_s": max(0.0, path - per_request)}
