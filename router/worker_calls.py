"""How the orchestrator awaits a worker: within a stage deadline, cancelled, or not at all.

`within` bounds one await by its stage deadline and by the request's own deadline, which the
worker enforces itself (the router allows it `DEADLINE_GRACE_S` to say so): past the request's
deadline it raises `RequestDeadlineExceeded`, past the stage's `StageTimeout` (the worker is
stuck or far behind). `cancel_remote` cancels a Ray call; `fire` marks a call nobody awaits.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from router.errors import StageTimeout
from vocabulary.waits import wait_within
from vocabulary.worker_api import RequestDeadlineExceeded

DEADLINE_GRACE_S = 1.0
"""How long past a request's deadline the router waits for the worker's own deadline error."""


async def within(
    awaitable: Any,
    stage_s: float,
    deadline: float | None,
    stage: str,
    worker_id: str,
    tokens_delivered: int,
) -> Any:
    """The result of `awaitable`, within `stage_s` and the request's `deadline` (+ grace)."""
    limit = stage_s
    request_bound = False
    if deadline is not None:
        remaining = deadline - time.time() + DEADLINE_GRACE_S
        if remaining < limit:
            limit, request_bound = max(remaining, 0.0), True
    try:
        return await wait_within(awaitable, limit)
    except TimeoutError:
        if request_bound:
            raise RequestDeadlineExceeded(f"request deadline passed in {stage}") from None
        raise StageTimeout(
            f"{stage}: worker {worker_id} did not answer within {stage_s:g}s "
            f"({tokens_delivered} tokens delivered)"
        ) from None


def cancel_remote(ref: Any) -> None:
    """Cancel a Ray call (an ObjectRef or a streaming generator), best effort."""
    import ray

    with contextlib.suppress(Exception):
        ray.cancel(ref)


def fire(ref: Any) -> None:
    """A best-effort call (an abort): Ray runs it whether or not anyone awaits the result,
    and its failure (the worker is gone) changes nothing for the caller."""
    del ref
