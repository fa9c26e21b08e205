"""The OpenAI-HTTP side both drivers share: planned request -> `/v1/completions` body, SSE
stream -> record.

A planned request is sent as a streaming completion of its token ids (`stream_options:
include_usage`, `return_token_ids`, so a chunk says how many tokens it carries). The Locust
user (gevent, geventhttpclient) and the asyncio driver (httpx2, the openai SDK's transport)
read the events their own way and hand each `data:` line to `SseStream` and the clock readings
to the same `StreamTimer`, so HTTP and gRPC records are measured identically: TTFT ends at the
first content chunk (one with text or tokens), TPOT is over the chunks that carry tokens.

A failed request's status is `HTTP_<code>` (`HTTP_429`, ...), with `retry-after-ms` (or
`Retry-After` seconds) as its retry hint; an error event inside a stream is `STREAM_ERROR`.

Works against any OpenAI-compatible server: without `return_token_ids` each content chunk
counts as one token, and the usage chunk sets the total.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loadtests.grpc_request import RpcFailure, client_fields
from loadtests.records import RequestRecord, StreamTimer
from loadtests.workload import PlannedRequest

COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"


def completion_body(planned: PlannedRequest, model: str) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": list(planned.token_ids),
        "max_tokens": planned.max_tokens,
        "temperature": planned.temperature,
        "ignore_eos": planned.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


def request_headers(planned: PlannedRequest) -> dict[str, str]:
    headers = {"content-type": "application/json", "x-request-id": planned.request_id}
    if planned.tenant:
        headers["x-pdserve-tenant"] = planned.tenant
    return headers


def served_model(models_body: bytes) -> str:
    """The first model a `GET /v1/models` answer lists."""
    data = json.loads(models_body)["data"]
    if not data:
        raise RuntimeError("the server lists no model")
    return str(data[0]["id"])


@dataclass
class SseStream:
    """The events of one streaming completion, fed line by line."""

    timer: StreamTimer
    usage: dict[str, Any] | None = None
    finish_reason: str = ""
    error: RpcFailure | None = None
    done: bool = False
    _token_chunks: int = field(default=0, repr=False)

    def feed(self, line: bytes | str, now: float) -> bool:
        """One line of the body; True when it carried the first token."""
        text = line.decode() if isinstance(line, bytes) else line
        text = text.strip()
        if not text.startswith("data:"):
            return False
        data = text[5:].strip()
        if data == "[DONE]":
            self.done = True
            return False
        event = json.loads(data)
        if "error" in event:
            err = event["error"] or {}
            self.error = RpcFailure("STREAM_ERROR", str(err.get("message", err)))
            return False
        if event.get("usage"):
            self.usage = event["usage"]
        first = False
        for choice in event.get("choices") or ():
            ids = choice.get("token_ids")
            tokens = len(ids) if ids is not None else (1 if choice.get("text") else 0)
            first = self.timer.on_message(now, tokens) or first
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return first


def http_failure(status: int, headers: Mapping[str, str], body: bytes) -> RpcFailure:
    """A refused request: its status, the error message, the retry hint."""
    message = body.decode(errors="replace")
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        message = json.loads(body)["error"]["message"]
    lower = {k.lower(): v for k, v in headers.items()}
    retry_after = None
    with contextlib.suppress(TypeError, ValueError):
        if "retry-after-ms" in lower:
            retry_after = float(lower["retry-after-ms"])
        elif "retry-after" in lower:
            retry_after = float(lower["retry-after"]) * 1000
    return RpcFailure(f"HTTP_{status}", message, retry_after)


def finish_openai_record(
    planned: PlannedRequest,
    stream: SseStream,
    *,
    run_start: float,
    ended_at: float,
    offered_rate: float | None,
    failure: RpcFailure | None = None,
) -> RequestRecord:
    timer = stream.timer
    if failure is None and stream.error is None and not stream.done:
        failure = RpcFailure("STREAM_CUT", "the stream ended before data: [DONE]")
    failure = failure or stream.error
    usage = stream.usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reason = stream.finish_reason
    return RequestRecord(
        **client_fields(planned, timer, run_start, ended_at, offered_rate, failure),
        finish_reason=f"FINISH_REASON_{reason.upper()}" if reason else "",
        cached_prompt_tokens=int(cached),
    )
