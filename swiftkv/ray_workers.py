"""Ray tasks in worker processes of their own.

Ray reuses an idle worker for any task of the same job and runtime env. Ray Data stops the tasks a
``limit()`` no longer needs (the calibration rows, the last training step's rows) with a
KeyboardInterrupt, and a worker stopped inside ``import torch`` keeps a half-imported torch: the
next task it runs fails with ``module 'torch' has no attribute ...``. A runtime env of their own
(one environment variable naming the pool) keeps our model tasks off the workers Ray Data used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray.remote_function import RemoteFunction

POOL_VARIABLE = "SWIFTKV_WORKER_POOL"


def remote_in_own_workers(fn: Callable[..., Any], pool: str, **options: Any) -> RemoteFunction:
    """``fn`` as a Ray task run only by workers started for ``pool``; ``options`` as ``ray.remote``'s
    (``max_calls=1``: a new worker for each call, which exits after it and gives its memory back)."""
    return ray.remote(runtime_env={"env_vars": {POOL_VARIABLE: pool}}, **options)(fn)
