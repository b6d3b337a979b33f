"""Ray Serve's control code on the simulated clock: the autoscaling policy and the request router a
deployment of ours gets, built from the same typed options and by Serve's own functions.

- Autoscaling: ``serve_apps.app.autoscaling_config`` gives the deployment's ``autoscaling_config``
  (our prefill policy, or Serve's default request-count policy); Serve resolves its policy
  (``_resolve_policy_callable``) and wraps it with its delays and scaling factors
  (``_apply_autoscaling_config``), then bounds the answer; the context is Serve's own
  ``AutoscalingContext``. Serve's delay logic reads ``time.time()``: during each call the simulated
  clock stands in for that module's ``time``.
- Routing: ``serve_apps.app.request_router_config`` names the router class (ours, or Serve's
  power-of-two router) and its kwargs, validated by Serve's ``RequestRouterConfig``; the router is built
  as Serve builds it for a handle (queue-length cache on, Serve's clock argument set to the
  simulated one), and each request goes through what Serve's routing loop calls: ``choose_replicas``,
  then ``_select_from_candidate_replicas`` on each rank (the replica with the fewest ongoing requests
  among those under ``max_ongoing_requests``), ``on_send_request`` and ``on_request_routed``; on
  completion, ``decrement_queue_len_cache`` and ``on_request_completed``. One change to Serve's
  code: its queue-length probe answers in the candidates' order (``_in_candidate_order``).

Serve pickles the policy and the router class by value to ship them to its controller and handles;
in one process the simulator imports them by their path instead (the same code, and no by-value copy
of a module's functions frozen at the first load).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle
from ray._common.utils import import_attr
from ray.serve import autoscaling_policy
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy, RequestRouterConfig

from serve_apps.app import autoscaling_config, request_router_config
from serve_apps.asgi import ForwardedRequest
from serve_apps.config import ModelOptions
from serve_apps.fleet.replica import Replica, SimRequest
from serve_apps.hints import PromptHint

DEPLOYMENT = DeploymentID(name="model-fleet", app_name="fleet")
SERVE_DEFAULT_OPTIONS = ("target_ongoing_requests", "upscale_delay_s", "downscale_delay_s", "metrics_interval_s",
                         "look_back_period_s")
"""The request-count policy's options a deployment that sets none runs with."""


def serve_autoscaling_defaults() -> dict[str, float]:
    """Serve's own defaults for :data:`SERVE_DEFAULT_OPTIONS`, read from the installed Serve's
    ``AutoscalingConfig`` (so a baseline at "Serve's defaults" is whatever this Serve's are)."""
    fields = AutoscalingConfig.model_fields
    return {name: float(fields[name].default) for name in SERVE_DEFAULT_OPTIONS}


@dataclass(frozen=True)
class SimReplicaID(ReplicaID):
    """A replica's id hashed by its number: Serve's power-of-two router draws its two candidates by
    position in a set of ids, and with the string hash (seeded per process) the same config and
    seed would give other choices, and other figures, in every process."""

    number: int = 0

    def __hash__(self) -> int:
        return self.number


class SimReplicaHandle:
    """What Serve's routers read of a ``RunningReplica``, for a simulated replica."""

    node_id = None
    availability_zone = None

    def __init__(self, replica: Replica, max_ongoing_requests: int) -> None:
        self.replica = replica
        self.replica_id = SimReplicaID(f"replica-{replica.number}", DEPLOYMENT, replica.number)
        self.max_ongoing_requests = max_ongoing_requests
        self.multiplexed_model_ids: set[str] = set()
        self.routing_stats: dict[str, float] = {}

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.replica.ongoing


class _Clock:
    """A stand-in for the ``time`` module that answers the simulated time."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    monotonic = time


@contextlib.contextmanager
def serve_clock(now: float) -> Iterator[None]:
    real = autoscaling_policy.time
    autoscaling_policy.time = _Clock(now)
    try:
        yield
    finally:
        autoscaling_policy.time = real


class Autoscaler:
    """The deployment's autoscaling policy, as Serve's controller applies it."""

    def __init__(self, options: ModelOptions) -> None:
        self.config = AutoscalingConfig(**autoscaling_config(options))
        policy = self.config.policy
        by_reference = AutoscalingPolicy.from_serialized_policy_def(
            policy.model_dump(), cloudpickle.dumps(import_attr(policy.policy_function)))
        self.policy = autoscaling_policy._apply_autoscaling_config(_resolve_policy_callable(by_reference))
        self.state: dict[str, Any] = {}
        self.last_scale_up_s: float | None = None
        self.last_scale_down_s: float | None = None

    def decide(self, now: float, running: list[ReplicaID], target: int, metrics: dict[str, dict[ReplicaID, float]],
               total_requests: float, queued_requests: float) -> int:
        """The new target replica count (Serve's bounds applied)."""
        bounds = (self.config.min_replicas, self.config.max_replicas)
        ctx = AutoscalingContext(
            deployment_id=DEPLOYMENT, deployment_name=DEPLOYMENT.name, app_name=DEPLOYMENT.app_name,
            current_num_replicas=len(running), target_num_replicas=target, running_replicas=running,
            total_num_requests=total_requests, total_queued_requests=queued_requests, aggregated_metrics=metrics,
            raw_metrics=None, capacity_adjusted_min_replicas=bounds[0], capacity_adjusted_max_replicas=bounds[1],
            policy_state=dict(self.state), last_scale_up_time=self.last_scale_up_s,
            last_scale_down_time=self.last_scale_down_s, current_time=now, config=self.config,
        )
        with serve_clock(now):
            wanted, self.state = self.policy(ctx)
        decided = max(bounds[0], min(bounds[1], math.ceil(wanted)))
        if decided > target:
            self.last_scale_up_s = now
        elif decided < target:
            self.last_scale_down_s = now
        return decided


ProbeQueueLens = Callable[[list[SimReplicaHandle], int], Awaitable[list[tuple[SimReplicaHandle, int | None]]]]


def _in_candidate_order(probe: ProbeQueueLens) -> ProbeQueueLens:
    """Serve's ``_probe_queue_lens`` with its answers in the candidates' order, as its docstring
    says they come: it collects them from the ``done`` set of ``asyncio.wait``, ordered by the tasks'
    memory addresses, and its caller keeps the first of two equally loaded candidates, so a
    power-of-two run placed requests differently from one run to the next."""

    async def in_order(replicas: list[SimReplicaHandle], backoff_index: int):
        position = {r.replica_id: i for i, r in enumerate(replicas)}
        answers = await probe(replicas, backoff_index)
        return sorted(answers, key=lambda answer: position[answer[0].replica_id])

    return in_order


class Router:
    """The deployment's request router, as a Serve handle drives it."""

    def __init__(self, options: ModelOptions, clock: Callable[[], float]) -> None:
        config = RequestRouterConfig(**request_router_config(options))
        self.stats_period_s = config.request_routing_stats_period_s
        self.router = import_attr(config.request_router_class)(
            deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
            use_replica_queue_len_cache=True, get_curr_time_s=clock,
        )
        self.router.initialize_state(**config.request_router_kwargs)
        self.router._probe_queue_lens = _in_candidate_order(self.router._probe_queue_lens)
        self.clock = clock

    def update_replicas(self, handles: list[SimReplicaHandle]) -> None:
        """Serve's broadcast of the running replicas (must run inside the event loop)."""
        self.router.update_replicas(handles)

    async def route(self, request: SimRequest, block_tokens: int) -> SimReplicaHandle | None:
        """The replica Serve would send ``request`` to now, or ``None`` if every candidate is full."""
        hint = PromptHint(float(request.input_tokens), request.blocks, block_tokens)
        key = str(request.index)
        pending = PendingRequest(args=[ForwardedRequest("POST", "/v1/completions", hint=hint)], kwargs={},
                                 metadata=RequestMetadata(request_id=key, internal_request_id=key),
                                 created_at=self.clock())
        # Serve retries a failed round at once with fresh choices (then backs off); a power-of-two
        # round sees two replicas, so give it as many rounds as there are replicas.
        for _ in range(max(1, len(self.router.curr_replicas))):
            ranks = await self.router.choose_replicas(list(self.router.curr_replicas.values()), pending)
            for rank in ranks:
                chosen = await self.router._select_from_candidate_replicas(rank, 0)
                if chosen is not None:
                    self.router.on_send_request(chosen.replica_id)
                    self.router.on_request_routed(pending, chosen.replica_id, None)
                    return chosen
            if len(ranks) > 1:
                return None  # a ranking router offered every replica: all are full
        return None

    def on_finished(self, handle: SimReplicaHandle, request: SimRequest) -> None:
        self.router.decrement_queue_len_cache(handle.replica_id)
        self.router.on_request_completed(handle.replica_id, str(request.index))
