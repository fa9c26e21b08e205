"""The orchestrator carrying out the recovery policy, over fake worker handles (no Ray): a
retry on another prefill worker keeps the attempt (same worker-facing id, same decode
worker), and a request that ends on its first token leaves no decode reservation behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from router_fakes import Method, make_info, make_load

from admission.config import AdmissionConfig, AdmissionThresholds
from admission.controller import AdmissionController
from decode_worker.api import DecodeRequest, TokenChunk
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from prefill_worker.api import PrefillRequest, PrefillResult
from router.cluster_view import ClusterView, StaticDirectory
from router.orchestrator import Orchestrator, StreamDelta
from router.validation import ValidRequest
from worker_runtime.api import WorkerDraining, WorkerInfo, WorkerLoad, WorkerRole

PROMPT = tuple(range(2, 40))


@dataclass
class FakePrefill:
    worker_id: str
    fail_with: list[BaseException] = field(default_factory=list)
    prefills: list[tuple[Any, ...]] = field(default_factory=list)
    aborts: list[tuple[Any, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.load = Method(self._load)
        self.prefill = Method(self._prefill, self.prefills)
        self.abort = Method(self._abort, self.aborts)

    async def _load(self) -> WorkerLoad:
        return make_load(self.worker_id, WorkerRole.PREFILL)

    async def _prefill(self, req: PrefillRequest) -> PrefillResult:
        if self.fail_with:
            raise self.fail_with.pop(0)
        ends = req.sampling.max_tokens == 1  # the request ends on its first token
        return PrefillResult(
            req.request_id, 7, "a", None, FinishReason.LENGTH if ends else None,
            None if ends else object(),  # type: ignore[arg-type]
            len(req.prompt_token_ids), 0, 0.0, 0.001, self.worker_id,
        )  # fmt: skip

    async def _abort(self, request_id: str) -> bool:
        return True


@dataclass
class FakeDecode:
    """Streams tokens 8, 9, ... after the first token until max_tokens."""

    worker_id: str
    submits: list[tuple[Any, ...]] = field(default_factory=list)
    aborts: list[tuple[Any, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._items: asyncio.Queue[list[Any]] = asyncio.Queue()
        self.load = Method(self._load)
        self.submit = Method(self._submit, self.submits)
        self.subscribe = Method(self._subscribe)
        self.renew = Method(lambda channel_id: None)
        self.abort = Method(self._abort, self.aborts)

    async def _load(self) -> WorkerLoad:
        return make_load(self.worker_id, WorkerRole.DECODE)

    async def _submit(self, req: DecodeRequest, channel_id: str) -> None:
        count = req.sampling.max_tokens
        for i in range(1, count):
            reason = FinishReason.LENGTH if i == count - 1 else None
            self._items.put_nowait([(req.request_id, TokenChunk((7 + i,), "b", None, reason))])

    async def _subscribe(self, channel_id: str, lease_s: float) -> AsyncIterator[Any]:
        while True:
            batch = await self._items.get()
            done: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
            done.set_result(batch)
            yield done

    async def _abort(self, request_id: str) -> bool:
        return True


async def _serve(
    prefill: list[FakePrefill], decode: list[FakeDecode], max_tokens: int
) -> tuple[list[StreamDelta], ClusterView]:
    workers: list[tuple[WorkerInfo, Any]] = [
        (make_info(p.worker_id, WorkerRole.PREFILL), p) for p in prefill
    ] + [(make_info(d.worker_id, WorkerRole.DECODE), d) for d in decode]
    view = ClusterView(StaticDirectory(workers))
    await view.start()
    thresholds = AdmissionThresholds(local_prefill_threshold_tokens=0)
    orchestrator = Orchestrator(
        view, AdmissionController(AdmissionConfig(thresholds=thresholds)), None, "m"
    )
    req = ValidRequest("client-1", PROMPT, SamplingParams(max_tokens=max_tokens), "", 0, "")
    try:
        got = [d async for d in orchestrator.generate(req, timeout_s=10)]
    finally:
        await asyncio.sleep(0.02)  # fire-and-forget aborts land
        await view.stop()
        for entry in view.entries.values():
            entry.close_channel("test done")
    assert orchestrator.inflight == 0 and orchestrator.running == 0
    return got, view


def serve(
    prefill: list[FakePrefill], decode: list[FakeDecode], max_tokens: int = 4
) -> tuple[list[StreamDelta], ClusterView]:
    return asyncio.run(_serve(prefill, decode, max_tokens))


def test_a_request_that_ends_on_its_first_token_releases_its_decode_reservation() -> None:
    decode = FakeDecode("decode-1")
    got, view = serve([FakePrefill("prefill-0")], [decode], max_tokens=1)
    assert [t for d in got for t in d.token_ids] == [7]
    assert got[-1].finish_reason is FinishReason.LENGTH and decode.submits == []
    assert [e.reserved_decode_blocks for e in view.entries.values()] == [0, 0]


def test_a_retry_on_another_prefill_worker_keeps_the_request_id_and_the_decode_worker() -> None:
    prefill = [FakePrefill("prefill-0", fail_with=[WorkerDraining("x")]), FakePrefill("prefill-1")]
    decode = [FakeDecode("decode-1")]
    got, view = serve(prefill, decode)
    assert [t for d in got for t in d.token_ids] == [7, 8, 9, 10]
    first, second = prefill[0].prefills[0][0], prefill[1].prefills[0][0]
    assert second.request_id == first.request_id  # the same attempt: no `~N`
    assert [call[0].request_id for call in decode[0].submits] == [first.request_id]
    assert prefill[0].aborts == [] and prefill[1].aborts == [] and decode[0].aborts == []
    timings = got[-1].timings
    assert timings is not None and timings.prefill_worker == "prefill-1"
    assert [e.reserved_decode_blocks for e in view.entries.values()] == [0, 0, 0]
