"""Locust users for pdserve's OpenAI-compatible HTTP API (streaming `/v1/completions`).

The same workload, schedule, events and records as the gRPC users of loadtests/locustfile.py
(`OpenLoopUser`, `ClosedLoopUser`: these subclasses change only how one request is sent),
over geventhttpclient: each SSE line is read as it arrives, TTFT ends at the first content
chunk and TPOT counts the tokens the chunks carry (loadtests/openai_client.py). Events are of
type "openai"; a failure's error is its HTTP status (`HTTP_429`).

    PDSERVE_BENCH_SPEC=... locust -f loadtests/locust_openai.py --headless -u 1 \
        --host http://HOST:PORT OpenAIOpenLoopUser
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial

from geventhttpclient import HTTPClient
from geventhttpclient.url import URL
from locust import User

from loadtests.grpc_request import RpcFailure
from loadtests.locustfile import ClosedLoopUser, OpenLoopUser
from loadtests.openai_client import (
    COMPLETIONS_PATH,
    MODELS_PATH,
    SseStream,
    completion_body,
    finish_openai_record,
    http_failure,
    request_headers,
    served_model,
)
from loadtests.records import RecordSink, RequestRecord, StreamTimer
from loadtests.runspec import RunSpec
from loadtests.workload import PlannedRequest

# At most this many requests in flight per user (an open-loop user sends the whole workload).
MAX_CONNECTIONS = 1024


class OpenAIConnection:
    """One user's HTTP client to the API at `host` (the served model asked once) and one
    request sent and measured on it."""

    def __init__(self, host: str, timeout_s: float) -> None:
        url = URL(host)
        self.http = HTTPClient.from_url(
            url, concurrency=MAX_CONNECTIONS, network_timeout=timeout_s, connection_timeout=10,
        )  # fmt: skip
        self.path = url.path.rstrip("/")
        reply = self.http.get(self.path + MODELS_PATH)
        body = reply.read()
        if reply.status_code != 200:
            raise RuntimeError(f"GET {MODELS_PATH}: HTTP {reply.status_code}")
        self.model = served_model(body)

    def close(self) -> None:
        self.http.close()

    def send(
        self,
        planned: PlannedRequest,
        run_start: float,
        rate: float | None,
        on_first_token: Callable[[float], None],
    ) -> RequestRecord:
        stream = SseStream(StreamTimer(sent_at=time.perf_counter()))
        failure: RpcFailure | None = None
        try:
            reply = self.http.post(
                self.path + COMPLETIONS_PATH,
                json.dumps(completion_body(planned, self.model)),
                headers=request_headers(planned),
            )
            if reply.status_code != 200:
                failure = http_failure(reply.status_code, dict(reply.headers), reply.read())
            else:
                while line := reply.readline(b"\n"):
                    if stream.feed(line, time.perf_counter()):
                        on_first_token(stream.timer.ttft_ms or 0.0)
            reply.release()
        except Exception as e:  # a client-side fault still yields a record
            failure = RpcFailure("CLIENT_ERROR", repr(e))
        return finish_openai_record(
            planned, stream, run_start=run_start, ended_at=time.perf_counter(),
            offered_rate=rate, failure=failure,
        )  # fmt: skip


def _fire(user: User, name: str, value: float, length: int, exc: Exception | None) -> None:
    user.environment.events.request.fire(
        request_type="openai", name=name, response_time=value, response_length=length,
        exception=exc, context={},
    )  # fmt: skip


class OpenAIOpenLoopUser(OpenLoopUser):
    """Sends the whole workload at its scheduled times over HTTP, then stops the run."""

    def on_start(self) -> None:
        self.spec = RunSpec.from_env()
        self.planned = self.spec.plan()
        self.sink = RecordSink(self.spec.records)
        if not self.host:
            raise RuntimeError("--host: the API's base URL (http://HOST:PORT)")
        self.api = OpenAIConnection(self.host, self.spec.request_timeout_s)

    def on_stop(self) -> None:
        self.api.close()
        self.sink.close()

    def send(self, planned: PlannedRequest, run_start: float) -> RequestRecord:
        record = self.api.send(planned, run_start, self.spec.rate, partial(self._fire, "TTFT"))
        self._report(record)
        self.sink.write(record)
        return record

    def _fire(self, name: str, value: float, length: int = 0, exc: Exception | None = None) -> None:
        _fire(self, name, value, length, exc)


class OpenAIClosedLoopUser(ClosedLoopUser):
    """Each user sends the next request as soon as its previous one is done, over HTTP."""

    on_start = OpenAIOpenLoopUser.on_start
    on_stop = OpenAIOpenLoopUser.on_stop
    send = OpenAIOpenLoopUser.send
    _fire = OpenAIOpenLoopUser._fire
