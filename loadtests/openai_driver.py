"""The asyncio driver's sender for the OpenAI HTTP API: one streaming `/v1/completions` per
planned request over httpx2 (the transport the openai SDK uses), measured as
loadtests/openai_client.py describes.

    async with OpenAISender("http://127.0.0.1:8000", rate, timeout_s) as send:
        record = await send(planned, run_start)
"""

from __future__ import annotations

import time
from types import TracebackType

import httpx2

from loadtests.grpc_request import RpcFailure
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
from loadtests.records import RequestRecord, StreamTimer
from loadtests.workload import PlannedRequest


class OpenAISender:
    """Sends planned requests to the OpenAI API at `base_url` (its model is asked once)."""

    def __init__(self, base_url: str, offered_rate: float | None, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.offered_rate = offered_rate
        self.timeout_s = timeout_s
        self.model = ""
        limits = httpx2.Limits(max_connections=None, max_keepalive_connections=256)
        self._client = httpx2.AsyncClient(timeout=timeout_s, limits=limits)

    async def __aenter__(self) -> OpenAISender:
        reply = await self._client.get(self.base_url + MODELS_PATH)
        reply.raise_for_status()
        self.model = served_model(reply.content)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._client.aclose()

    async def __call__(self, planned: PlannedRequest, run_start: float) -> RequestRecord:
        stream = SseStream(StreamTimer(sent_at=time.perf_counter()))
        failure: RpcFailure | None = None
        try:
            async with self._client.stream(
                "POST",
                self.base_url + COMPLETIONS_PATH,
                json=completion_body(planned, self.model),
                headers=request_headers(planned),
            ) as reply:
                if reply.status_code != 200:
                    body = await reply.aread()
                    failure = http_failure(reply.status_code, reply.headers, body)
                else:
                    async for line in reply.aiter_lines():
                        stream.feed(line, time.perf_counter())
        except httpx2.HTTPError as e:
            failure = RpcFailure("CONNECTION_ERROR", repr(e))
        except Exception as e:  # a client-side fault still yields a record
            failure = RpcFailure("CLIENT_ERROR", repr(e))
        return finish_openai_record(
            planned,
            stream,
            run_start=run_start,
            ended_at=time.perf_counter(),
            offered_rate=self.offered_rate,
            failure=failure,
        )
