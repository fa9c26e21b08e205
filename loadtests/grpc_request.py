"""The gRPC side both drivers share: planned request -> `GenerateRequest`, stream -> record.

The Locust user (gevent, blocking stubs) and the asyncio driver (grpc.aio) iterate the stream
their own way and hand the clock readings to the same `StreamTimer` and `finish_record`, so
their records are measured identically.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import grpc

from loadtests.records import OK, RequestRecord, StreamTimer
from loadtests.workload import PlannedRequest
from pdserve.v1 import serving_pb2

RETRY_AFTER_KEY = "retry-after-ms"


@dataclass(frozen=True)
class RpcFailure:
    status: str
    """gRPC status code name."""
    details: str
    retry_after_ms: float | None = None


def to_proto(planned: PlannedRequest) -> serving_pb2.GenerateRequest:
    return serving_pb2.GenerateRequest(
        request_id=planned.request_id,
        token_ids=list(planned.token_ids),
        max_tokens=planned.max_tokens,
        temperature=planned.temperature,
        ignore_eos=planned.ignore_eos,
        tenant=planned.tenant,
    )


def rpc_failure(error: grpc.RpcError) -> RpcFailure:
    """Status, details and retry-after of a failed call (sync or aio)."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    retry_after = None
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in metadata or ():
        if key == RETRY_AFTER_KEY:
            with contextlib.suppress(TypeError, ValueError):
                retry_after = float(value)
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    return RpcFailure(name, details or "", retry_after)


def finish_record(
    planned: PlannedRequest,
    timer: StreamTimer,
    *,
    run_start: float,
    ended_at: float,
    offered_rate: float | None,
    last: serving_pb2.GenerateResponse | None = None,
    failure: RpcFailure | None = None,
) -> RequestRecord:
    usage = last.usage if last is not None and last.HasField("usage") else None
    timings = last.timings if last is not None and last.HasField("timings") else None
    finish_reason = ""
    if last is not None and last.finish_reason:
        finish_reason = serving_pb2.FinishReason.Name(last.finish_reason)
    return RequestRecord(
        **client_fields(planned, timer, run_start, ended_at, offered_rate, failure),
        finish_reason=finish_reason,
        cached_prompt_tokens=usage.cached_prompt_tokens if usage is not None else 0,
        server_queue_ms=timings.queue_ms if timings is not None else None,
        server_ttft_ms=timings.ttft_ms if timings is not None else None,
        server_prefill_ms=timings.prefill_ms if timings is not None else None,
        server_transfer_ms=timings.transfer_ms if timings is not None else None,
    )


def client_fields(
    planned: PlannedRequest,
    timer: StreamTimer,
    run_start: float,
    ended_at: float,
    offered_rate: float | None,
    failure: RpcFailure | None,
) -> dict[str, Any]:
    """The fields of a RequestRecord the client knows whatever the API: what it planned,
    what it timed and how the request ended."""
    return dict(
        request_id=planned.request_id,
        index=planned.index,
        sent_s=timer.sent_at - run_start,
        scheduled_s=planned.send_at_s,
        prompt_tokens=planned.prompt_tokens,
        max_tokens=planned.max_tokens,
        output_tokens=timer.output_tokens,
        e2e_ms=timer.e2e_ms(ended_at),
        ttft_ms=timer.ttft_ms,
        tpot_ms=timer.tpot_ms,
        itl_ms=timer.itl_ms,
        status=OK if failure is None else failure.status,
        error="" if failure is None else failure.details,
        retry_after_ms=None if failure is None else failure.retry_after_ms,
        offered_rate=offered_rate,
        conversation=planned.conversation,
        turn=planned.turn,
    )
