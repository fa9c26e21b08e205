"""Failures as OpenAI-shaped HTTP errors.

Every failure of a request already maps to one gRPC status in router/errors.py; the HTTP
door maps that status on, through one table, so both doors end a request the same way:

    gRPC status          HTTP  OpenAI `type`           `code`
    INVALID_ARGUMENT     400   invalid_request_error   (none; `param` names the field)
    UNAUTHENTICATED      401   invalid_request_error   invalid_api_key (+ WWW-Authenticate)
    PERMISSION_DENIED    403   invalid_request_error   permission_denied
    NOT_FOUND            404   invalid_request_error   model_not_found (the HTTP door's own)
    FAILED_PRECONDITION  424   server_error            adapter_load_failed (a LoRA's files)
    RESOURCE_EXHAUSTED   429   rate_limit_error        rate_limit_exceeded, + Retry-After
    CANCELLED            503   server_error            request_aborted (a worker aborted it)
    UNAVAILABLE          503   server_error            service_unavailable
    DEADLINE_EXCEEDED    504   server_error            timeout
    INTERNAL             500   server_error            internal_error

The body is `{"error": {"message", "type", "param", "code"}}`. A 429 carries `Retry-After`
(whole seconds, rounded up, as HTTP defines it) and `retry-after-ms` (what the gRPC trailer
says; the openai SDKs read it first).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from router.errors import RETRY_AFTER_KEY, to_grpc_failure, unwrap
from router.validation import InvalidRequest
from vocabulary.sampling import SamplingParamsError

_BY_STATUS: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "invalid_request_error", "permission_denied"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.FAILED_PRECONDITION: (424, "server_error", "adapter_load_failed"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (503, "server_error", "request_aborted"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
    grpc.StatusCode.INTERNAL: (500, "server_error", "internal_error"),
}


@dataclass(frozen=True)
class HttpFailure:
    """An error response: status, OpenAI error object, and the retry hint of a 429."""

    status: int
    type: str
    message: str
    param: str | None = None
    code: str | None = None
    retry_after_ms: int | None = None
    outcome: str = "error"
    """Label for the router's request metrics (as `GrpcFailure.outcome`)."""

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.type, "param": self.param,
                 "code": self.code}  # fmt: skip
        return json.dumps({"error": error}).encode()

    def headers(self) -> dict[str, str]:
        if self.status == 401:
            return {"www-authenticate": 'Bearer realm="pdserve"'}
        if self.retry_after_ms is None:
            return {}
        return {
            "retry-after": str(max(1, math.ceil(self.retry_after_ms / 1000))),
            RETRY_AFTER_KEY: str(self.retry_after_ms),
        }


class ApiError(Exception):
    """A failure the HTTP door decides itself (unknown model or route, a body too large)."""

    def __init__(self, failure: HttpFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def failure(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> HttpFailure:
    """A door-made failure with the type its status has in the table."""
    type_ = next((t for s, t, _ in _BY_STATUS.values() if s == status), "invalid_request_error")
    outcome = "invalid" if status < 500 else "error"
    return HttpFailure(status, type_, message, param, code, outcome=outcome)


def to_http_failure(exc: BaseException, param_name: Callable[[str], str] = str) -> HttpFailure:
    """The HTTP error a request that raised `exc` ends with. `param_name` turns a field of
    the internal request (`token_ids`) into the body's (`prompt`); the message then starts
    with the body's name."""
    if isinstance(exc, ApiError):
        return exc.failure
    grpc_failure = to_grpc_failure(exc)
    status, type_, code = _BY_STATUS.get(grpc_failure.code, (500, "server_error", "internal_error"))
    message, param = grpc_failure.message, None
    field = _field(exc)
    if field is not None and grpc_failure.code is grpc.StatusCode.INVALID_ARGUMENT:
        param = param_name(field)
        if message.startswith(f"{field}: "):
            message = f"{param}: {message[len(field) + 2 :]}"
    retry_after_ms = None
    for key, value in grpc_failure.trailing_metadata:
        if key == RETRY_AFTER_KEY:
            retry_after_ms = int(value)
    return HttpFailure(status, type_, message, param, code, retry_after_ms, grpc_failure.outcome)


def _field(exc: BaseException) -> str | None:
    err = unwrap(exc)
    if isinstance(err, (InvalidRequest, SamplingParamsError)):
        return err.field
    return None
