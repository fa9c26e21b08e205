"""Every failure of a request mapped to one gRPC status, in one place.

    InvalidRequest / SamplingParamsError      INVALID_ARGUMENT (message names the field)
    UnknownLora, LoraNotFound (a worker's)    NOT_FOUND (names the adapter)
    LoraLoadError (a worker could not read it) FAILED_PRECONDITION
    AdmissionRejected                         RESOURCE_EXHAUSTED + `retry-after-ms` trailer,
                                              except NO_LIVE_WORKER -> UNAVAILABLE,
                                              REQUEST_TOO_LARGE -> INVALID_ARGUMENT,
                                              DEADLINE_UNREACHABLE -> DEADLINE_EXCEEDED
    RequestDeadlineExceeded / TimeoutError    DEADLINE_EXCEEDED
    RequestAborted (a worker's abort)         CANCELLED
    NoWorkerError, WorkerLost, StageTimeout   UNAVAILABLE
    WorkerStopped, StepFailed (after retries) UNAVAILABLE
    TransferError (after the retry)           UNAVAILABLE
    WorkerOverloaded / WorkerDraining         RESOURCE_EXHAUSTED + `retry-after-ms`
    anything else                             INTERNAL (a server fault, never bad input)

A failure after tokens went out arrives as `StreamCut(error, n)`: the error's status, its
message followed by "(n tokens delivered)".

Worker exceptions arrive wrapped by Ray (`RayTaskError`); `unwrap` digs out the cause.

Whether a failure ends the request at all (or is retried on other workers first) is decided
beside this table, by the recovery policy (router/recovery.py); this table maps only what a
request ends with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import grpc

from admission.decision import AdmissionRejected, Reason
from router.placement import NoWorkerError
from router.validation import InvalidRequest, UnknownLora
from vocabulary.engine_io import LoraLoadError, LoraNotFound
from vocabulary.sampling import SamplingParamsError
from vocabulary.transfer_errors import TransferError
from vocabulary.worker_api import (
    RequestAborted,
    RequestDeadlineExceeded,
    StepFailed,
    WorkerDraining,
    WorkerOverloaded,
    WorkerStopped,
)

RETRY_AFTER_KEY = "retry-after-ms"
DEFAULT_RETRY_AFTER_MS = 500


class WorkerLost(Exception):
    """A worker died (or stopped answering) while serving the request."""


class StreamCut(Exception):
    """A stream that failed after tokens went out to the client: the failure, and how many
    tokens the client got (its status is the failure's, with the count in the message)."""

    def __init__(self, error: BaseException, tokens_delivered: int) -> None:
        super().__init__(f"{error} ({tokens_delivered} tokens delivered)")
        self.error = error
        self.tokens_delivered = tokens_delivered


class StageTimeout(WorkerLost):
    """A worker missed a stage deadline of the request (prefill answer, hand-off, gap between
    tokens): it is stuck or far behind. UNAVAILABLE, like a lost worker."""


@dataclass(frozen=True)
class GrpcFailure:
    """A status to end the call with."""

    code: grpc.StatusCode
    message: str
    trailing_metadata: tuple[tuple[str, str], ...] = ()
    outcome: str = "error"
    """Label for metrics (invalid, rejected, deadline, cancelled, unavailable, internal)."""


def unwrap(exc: BaseException) -> BaseException:
    """The original exception inside Ray's wrappers (RayTaskError.cause), if any."""
    seen = 0
    while seen < 8:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException) and cause is not exc:
            exc = cause
            seen += 1
            continue
        break
    return exc


def _retry(ms: float | None) -> tuple[tuple[str, str], ...]:
    return ((RETRY_AFTER_KEY, str(int(ms if ms is not None else DEFAULT_RETRY_AFTER_MS))),)


def to_grpc_failure(exc: BaseException) -> GrpcFailure:
    exc = unwrap(exc)
    if isinstance(exc, StreamCut):
        inner = to_grpc_failure(exc.error)
        return replace(inner, message=f"{inner.message} ({exc.tokens_delivered} tokens delivered)")
    code = grpc.StatusCode
    if isinstance(exc, (InvalidRequest, SamplingParamsError)):
        return GrpcFailure(code.INVALID_ARGUMENT, str(exc), outcome="invalid")
    if isinstance(exc, (UnknownLora, LoraNotFound)):
        return GrpcFailure(code.NOT_FOUND, str(exc), outcome="invalid")
    if isinstance(exc, LoraLoadError):
        return GrpcFailure(code.FAILED_PRECONDITION, str(exc), outcome="invalid")
    if isinstance(exc, AdmissionRejected):
        if exc.reason is Reason.NO_LIVE_WORKER:
            return GrpcFailure(code.UNAVAILABLE, exc.message, outcome="unavailable")
        if exc.reason is Reason.REQUEST_TOO_LARGE:
            return GrpcFailure(code.INVALID_ARGUMENT, exc.message, outcome="invalid")
        if exc.reason is Reason.DEADLINE_UNREACHABLE:
            return GrpcFailure(code.DEADLINE_EXCEEDED, exc.message, outcome="deadline")
        return GrpcFailure(
            code.RESOURCE_EXHAUSTED, exc.message, _retry(exc.retry_after_ms), "rejected"
        )
    if isinstance(exc, (RequestDeadlineExceeded, TimeoutError)):
        return GrpcFailure(code.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded", (), "deadline")
    if isinstance(exc, RequestAborted):
        return GrpcFailure(code.CANCELLED, str(exc), outcome="cancelled")
    if isinstance(exc, (WorkerOverloaded, WorkerDraining)):
        return GrpcFailure(code.RESOURCE_EXHAUSTED, str(exc), _retry(None), "rejected")
    if isinstance(exc, (NoWorkerError, WorkerLost, TransferError, WorkerStopped, StepFailed)):
        return GrpcFailure(code.UNAVAILABLE, str(exc), outcome="unavailable")
    if is_actor_death(exc):
        return GrpcFailure(code.UNAVAILABLE, f"worker lost: {exc}", outcome="unavailable")
    return GrpcFailure(
        code.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", outcome="internal"
    )


def is_actor_death(exc: BaseException) -> bool:
    try:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    except ImportError:
        return False
    return isinstance(exc, (RayActorError, ActorDiedError, ActorUnavailableError))
