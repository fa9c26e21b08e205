"""The orchestrator's hand-off retry, over fake worker handles (no Ray): a hand-off that fails
before the first decoded token is prefilled again under a fresh worker-facing request id, the
failed attempt is aborted on both workers, and the client's stream goes on from the first
token it already has; a second failure ends the request with the typed error. Each attempt's
placement is counted by why it went where it went."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from router_fakes import Method
from router_fakes import make_info as info
from router_fakes import make_load as load

from admission.config import AdmissionConfig, AdmissionThresholds
from admission.controller import AdmissionController
from router.cluster_view import ClusterView, StaticDirectory
from router.errors import StreamCut
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator, OrchestratorConfig, StreamDelta
from router.placement import PrefillReason
from router.prefill_cost import LocalPrefillConfig, PrefillCostModel
from router.validation import ValidRequest
from vocabulary.decode_api import ChunkError, DecodeRequest, TokenChunk
from vocabulary.engine_io import FinishReason
from vocabulary.prefill_api import PrefillRequest, PrefillResult
from vocabulary.sampling import SamplingParams
from vocabulary.transfer_errors import TransferTimeout
from vocabulary.worker_api import WorkerLoad, WorkerRole

FIRST_TOKEN = 7
DECODED = (8, 9, 10)


class FakePrefill:
    def __init__(self) -> None:
        self.prefills: list[tuple[Any, ...]] = []
        self.aborts: list[tuple[Any, ...]] = []
        self.load = Method(self._load, [])
        self.prefill = Method(self._prefill, self.prefills)
        self.abort = Method(self._abort, self.aborts)

    async def _load(self) -> WorkerLoad:
        return load("prefill-0", WorkerRole.PREFILL)

    async def _prefill(self, req: PrefillRequest) -> PrefillResult:
        return PrefillResult(
            req.request_id, FIRST_TOKEN, "a", None, None, object(),  # type: ignore[arg-type]
            len(req.prompt_token_ids), 0, 0.0, 0.001, "prefill-0",
        )  # fmt: skip

    async def _abort(self, request_id: str) -> bool:
        return True


class FakeDecode:
    """Fails the pull of the first `failures` requests submitted (a ChunkError on the channel,
    as a real worker reports a transfer timeout), then streams DECODED for the next."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.submits: list[tuple[Any, ...]] = []
        self.aborts: list[tuple[Any, ...]] = []
        self._items: asyncio.Queue[list[Any]] = asyncio.Queue()
        self.load = Method(self._load, [])
        self.submit = Method(self._submit, self.submits)
        self.subscribe = Method(self._subscribe, [])
        self.renew = Method(lambda channel_id: None, [])
        self.abort = Method(self._abort, self.aborts)

    async def _load(self) -> WorkerLoad:
        return load("decode-1", WorkerRole.DECODE)

    async def _submit(self, req: DecodeRequest, channel_id: str) -> None:
        assert req.first_token_id == FIRST_TOKEN  # the retry decodes after the token sent
        rid = req.request_id
        if len(self.submits) <= self.failures:
            self._items.put_nowait([ChunkError(rid, TransferTimeout(f"request {rid}: deadline"))])
            return
        for i, token in enumerate(DECODED):
            last = i == len(DECODED) - 1
            chunk = TokenChunk((token,), "b", finish_reason=FinishReason.LENGTH if last else None)
            self._items.put_nowait([(rid, chunk)])

    async def _subscribe(self, channel_id: str, lease_s: float) -> AsyncIterator[Any]:
        while True:
            batch = await self._items.get()
            done: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
            done.set_result(batch)
            yield done

    async def _abort(self, request_id: str) -> bool:
        return True


def run_request(
    failures: int, config: OrchestratorConfig | None = None, metrics: RouterMetrics | None = None
) -> tuple[list[StreamDelta] | BaseException, Any, Any, Any]:
    async def scenario() -> tuple[list[StreamDelta] | BaseException, Any, Any, Any]:
        prefill, decode = FakePrefill(), FakeDecode(failures)
        view = ClusterView(
            StaticDirectory(
                [
                    (info("prefill-0", WorkerRole.PREFILL), prefill),
                    (info("decode-1", WorkerRole.DECODE), decode),
                ]
            )
        )
        await view.start()
        thresholds = AdmissionThresholds(local_prefill_threshold_tokens=0)
        admission = AdmissionController(AdmissionConfig(thresholds=thresholds))
        orchestrator = Orchestrator(view, admission, None, "m", config, metrics)
        req = ValidRequest("client-1", tuple(range(2, 40)), SamplingParams(max_tokens=4), "", 0, "")
        got: list[StreamDelta] | BaseException
        try:
            got = [d async for d in orchestrator.generate(req, timeout_s=10)]
        except Exception as e:
            got = e
        await asyncio.sleep(0.05)  # fire-and-forget aborts land
        await view.stop()
        for entry in view.entries.values():
            entry.close_channel("test done")
        assert orchestrator.inflight == 0 and orchestrator.running == 0
        return got, prefill, decode, admission

    return asyncio.run(scenario())


def test_a_failed_hand_off_is_prefilled_again_under_a_fresh_id_and_the_stream_goes_on() -> None:
    got, prefill, decode, _ = run_request(failures=1)
    assert isinstance(got, list), got
    assert [t for d in got for t in d.token_ids] == [FIRST_TOKEN, *DECODED]
    assert got[-1].finish_reason is FinishReason.LENGTH
    assert got[-1].usage is not None and got[-1].usage.completion_tokens == 4
    first_id, retry_id = (call[0].request_id for call in prefill.prefills)
    assert first_id.startswith("client-1@") and retry_id == f"{first_id}~1"
    assert [call[0].request_id for call in decode.submits] == [first_id, retry_id]
    # the failed attempt is ended on both workers; the retry finished, so nothing else is
    assert [call[0] for call in prefill.aborts] == [first_id]
    assert [call[0] for call in decode.aborts] == [first_id]


def test_a_second_failed_hand_off_ends_the_request_with_the_typed_error() -> None:
    got, prefill, decode, _ = run_request(failures=2)
    # the first token went out: the typed error arrives with the count the client got
    assert isinstance(got, StreamCut) and got.tokens_delivered == 1, got
    assert isinstance(got.error, TransferTimeout), got.error
    assert len(prefill.prefills) == 2  # max_handoff_retries = 1
    first_id = prefill.prefills[0][0].request_id
    assert sorted(call[0] for call in prefill.aborts) == [first_id, f"{first_id}~1"]
    assert sorted(call[0] for call in decode.aborts) == [first_id, f"{first_id}~1"]


def test_a_hand_off_that_works_is_not_retried() -> None:
    got, prefill, decode, _ = run_request(failures=0)
    assert isinstance(got, list) and len(prefill.prefills) == 1 and decode.aborts == []


def test_each_attempt_is_placed_by_the_configured_policy_and_counted() -> None:
    # a free hand-off: the cost policy finds both ways equally fast, and a tie goes remote
    free = PrefillCostModel(
        "free hand-off", 2048, (1, 100), (0.001, 0.01), 0.0, (100,), ((1,),), ((0.01,),),
        handoff_fixed_s=0.0, handoff_per_block_s=0.0,
    )  # fmt: skip
    config = OrchestratorConfig(local_prefill=LocalPrefillConfig(policy="cost", cost=free))
    metrics = RouterMetrics()
    got, prefill, _, _ = run_request(failures=1, config=config, metrics=metrics)
    assert isinstance(got, list) and len(prefill.prefills) == 2
    counted = {
        why: metrics.registry.get_sample_value(
            "pdserve_prefill_placements_total", {"site": "remote", "reason": why.value}
        )
        for why in (PrefillReason.REMOTE_CHEAPER, PrefillReason.FIRST_TOKEN_OUT)
    }
    # the retry after the first token may not prefill locally: it is not asked the cost model
    assert counted == {PrefillReason.REMOTE_CHEAPER: 1.0, PrefillReason.FIRST_TOKEN_OUT: 1.0}
