"""``swiftkv fleet calibrate-serve``: a variant's timing curves measured through the running
``swiftkv serve`` endpoint instead of a bare engine.

``swiftkv calibrate`` times vLLM engines in Ray tasks. Where Serve's own processes (HTTP proxy,
ingress, the replica actors' output streaming) share the replicas' CPUs, as on a small CPU host,
the replicas behind the endpoint run slower than those engines, and a profile measured outside
Serve makes the simulator's replicas too fast. Here the same figures are measured with requests of
fixed shapes sent through the endpoint the validation replays against (same deployment, router and
replica count), each batch spread over every replica at once:

- prefill: ``num_prompts`` prompts per replica of each length, one output token each, sent
  together; uncached prompt tokens/s per replica from the time to the last response;
- decode: ``batch`` sequences per replica, sent together twice, with 1 and with
  ``1 + decode_tokens`` output tokens; the difference over ``decode_tokens`` is one step.

Every prompt starts with a block no other request has, so the prefix cache never helps. The
engine's limits (KV capacity, token budget, sequence cap, start-up time) are not timing and are
kept from the engine profile.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from serve_apps.fleet.config import ServeCalibration
from serve_apps.fleet.profile import ModelFigures, Profile
from serve_apps.fleet.replay import Burst
from serve_apps.fleet.validate import ValidateConfig, served_name, serving


def measure(burst: Burst, replicas: int, cal: ServeCalibration, rounds: int) -> dict[str, Any]:
    """Every point, each the median of ``rounds`` measurements."""
    prefill = {n: statistics.median(cal.num_prompts * n / burst.seconds(replicas * cal.num_prompts, n, 1)
                                    for _ in range(rounds))
               for n in sorted(cal.input_lens)}

    def step_s(batch: int, context: int) -> float:
        steps = []
        for _ in range(rounds):
            one = burst.seconds(replicas * batch, context, 1)
            more = burst.seconds(replicas * batch, context, 1 + cal.decode_tokens)
            steps.append(max(more - one, 0.0) / cal.decode_tokens)
        return statistics.median(steps)

    by_batch = {b: step_s(b, cal.decode_context_tokens) for b in sorted(cal.batches)}
    context_batch = max(cal.batches)
    by_context = {c: step_s(context_batch, c) for c in sorted(cal.decode_contexts)}
    return {"prefill_tokens_per_s_by_input_len": prefill, "decode_step_s_by_batch": by_batch,
            "decode_step_s_by_context": by_context, "decode_context_batch": context_batch}


def serve_figures(base: ModelFigures, curves: dict[str, Any], cfg: ValidateConfig) -> ModelFigures:
    """``base`` (the engine profile's figures) with its timing curves replaced by those measured
    through the endpoint; its engine limits and start-up time kept."""
    prefill, cal = curves["prefill_tokens_per_s_by_input_len"], cfg.calibration
    return ModelFigures.model_validate({
        **base.model_dump(), **curves, "prefill_tokens_per_s": prefill[max(prefill)],
        "decode_context_tokens": cal.decode_context_tokens, "num_prompts": cal.num_prompts,
        "rounds": cal.rounds, "side_by_side": cfg.replicas,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "timed_unix": None,
        "notes": f"timing measured through swiftkv serve ({cfg.serve_config}, {cfg.replicas} replicas, "
                 f"router {cfg.fleet.routing.router}); engine limits and start-up from the engine profile",
    })


def calibrate_through_serve(cfg: ValidateConfig, engine_profile: Profile) -> Profile:
    """Start the validation's endpoint, measure ``cfg.model``'s curves through it (``cfg.calibration``),
    stop it: a one-variant profile."""
    cal = cfg.calibration
    base = engine_profile.figures(cfg.model)
    with serving(cfg, base.prefill_tokens_per_s) as endpoint:
        burst = Burst(endpoint.url, served_name(cfg), cfg.request_timeout_s)
        print(f"warm-up pass over every shape through {endpoint.url}", flush=True)
        measure(burst, cfg.replicas, cal, rounds=1)
        print(f"measuring ({cal.rounds} rounds)", flush=True)
        curves = measure(burst, cfg.replicas, cal, cal.rounds)
    return Profile(source="swiftkv fleet calibrate-serve", models={cfg.model: serve_figures(base, curves, cfg)})
