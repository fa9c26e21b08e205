"""The orchestrator's fault paths over fake worker handles (no Ray): every retry path delivers
each token exactly once (ignore_eos, counted), a burst spreads over idle decode workers, and a
worker that stops answering ends its requests with UNAVAILABLE within the stage deadline.

The fakes generate a deterministic stream: the token at absolute position p (counted from the
start of the prompt) is `100 + p`, whichever worker computes it, so a duplicated or skipped
token shows in the list."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from router_fakes import Method, make_info, make_load

from admission.config import AdmissionConfig, AdmissionThresholds
from admission.controller import AdmissionController
from router.cluster_view import ClusterView, ClusterViewConfig, StaticDirectory
from router.errors import StageTimeout, StreamCut, WorkerLost, to_grpc_failure
from router.orchestrator import Orchestrator, OrchestratorConfig, StreamDelta
from router.validation import ValidRequest
from vocabulary.decode_api import ChunkError, DecodeRequest, TokenChunk
from vocabulary.engine_io import FinishReason
from vocabulary.prefill_api import PrefillRequest, PrefillResult
from vocabulary.sampling import SamplingParams
from vocabulary.transfer_errors import TransferTimeout
from vocabulary.worker_api import (
    StepFailed,
    WorkerDraining,
    WorkerInfo,
    WorkerLoad,
    WorkerOverloaded,
    WorkerRole,
)

PROMPT = tuple(range(2, 40))
MAX_TOKENS = 6
EXPECTED = [100 + len(PROMPT) + k for k in range(MAX_TOKENS)]


def token_at(position: int) -> int:
    return 100 + position


@dataclass
class FakePrefill:
    worker_id: str
    fail_with: list[BaseException] = field(default_factory=list)
    """Raised by the next prefill calls, one each, before it answers normally."""
    hang: bool = False
    prefills: list[tuple[Any, ...]] = field(default_factory=list)
    aborts: list[tuple[Any, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.load = Method(self._load)
        self.prefill = Method(self._prefill, self.prefills)
        self.abort = Method(self._abort, self.aborts)

    async def _load(self) -> WorkerLoad:
        return make_load(self.worker_id, WorkerRole.PREFILL)

    async def _prefill(self, req: PrefillRequest) -> PrefillResult:
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail_with:
            raise self.fail_with.pop(0)
        n = len(req.prompt_token_ids)
        # a request of max_tokens=1 ends on its first token: nothing is handed off
        ends = req.sampling.max_tokens == 1
        return PrefillResult(
            req.request_id, token_at(n), "a", None, FinishReason.LENGTH if ends else None,
            None if ends else object(),  # type: ignore[arg-type]
            n, 0, 0.0, 0.001, self.worker_id,
        )  # fmt: skip

    async def _abort(self, request_id: str) -> bool:
        return True


@dataclass
class FakeDecode:
    """Streams the request's tokens on its channel; `fail_pulls` hand-offs fail with a
    ChunkError first, `refuse_with` submits raise, `hang_after` tokens it goes silent."""

    worker_id: str
    fail_pulls: int = 0
    refuse_with: list[BaseException] = field(default_factory=list)
    hang_after: int | None = None
    used_blocks: int = 0
    submits: list[tuple[Any, ...]] = field(default_factory=list)
    aborts: list[tuple[Any, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._items: asyncio.Queue[list[Any]] = asyncio.Queue()
        self._tasks: set[asyncio.Future[None]] = set()
        self.load = Method(self._load)
        self.submit = Method(self._submit, self.submits)
        self.subscribe = Method(self._subscribe)
        self.renew = Method(lambda channel_id: None)
        self.abort = Method(self._abort, self.aborts)

    async def _load(self) -> WorkerLoad:
        return make_load(self.worker_id, WorkerRole.DECODE, self.used_blocks)

    async def _submit(self, req: DecodeRequest, channel_id: str) -> None:
        # the worker's own contract (decode_worker/worker.py `_start`)
        assert (req.handle is None) == (req.first_token_id is None), req
        if self.refuse_with:
            raise self.refuse_with.pop(0)
        rid = req.request_id
        if req.handle is not None and self.fail_pulls > 0:
            self.fail_pulls -= 1
            self._items.put_nowait([ChunkError(rid, TransferTimeout(f"request {rid}: deadline"))])
            return
        task = asyncio.ensure_future(self._stream(req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stream(self, req: DecodeRequest) -> None:
        n = len(req.prompt_token_ids)
        # a local prefill samples its first token itself; a pulled request starts after it,
        # a migrated one after the tokens its client has (its prior, counted as output)
        first = len(req.prior.token_ids) + (0 if req.handle is None else 1)
        count = req.sampling.max_tokens
        for i in range(first, count):
            if self.hang_after is not None and i - first >= self.hang_after:
                return  # silent from here on: a stuck worker
            last = i == count - 1
            chunk = TokenChunk(
                (token_at(n + i),), "b", finish_reason=FinishReason.LENGTH if last else None
            )
            self._items.put_nowait([(req.request_id, chunk)])
            await asyncio.sleep(0.001)

    async def _subscribe(self, channel_id: str, lease_s: float) -> AsyncIterator[Any]:
        while True:
            batch = await self._items.get()
            done: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
            done.set_result(batch)
            yield done

    async def _abort(self, request_id: str) -> bool:
        return True


@dataclass
class Setup:
    prefill: list[FakePrefill]
    decode: list[FakeDecode]
    config: OrchestratorConfig = field(default_factory=OrchestratorConfig)


async def _serve(
    setup: Setup, requests: int = 1, max_tokens: int = MAX_TOKENS, between: Any = None
) -> tuple[list[list[StreamDelta] | BaseException], Orchestrator]:
    workers: list[tuple[WorkerInfo, Any]] = [
        (make_info(p.worker_id, WorkerRole.PREFILL), p) for p in setup.prefill
    ] + [(make_info(d.worker_id, WorkerRole.DECODE), d) for d in setup.decode]
    directory = StaticDirectory(workers)
    # no poll between the requests of a burst: what spreads them is the router's own count
    view = ClusterView(
        directory, config=ClusterViewConfig(poll_interval_s=60, idle_poll_interval_s=60)
    )
    await view.start()
    thresholds = AdmissionThresholds(local_prefill_threshold_tokens=0)
    admission = AdmissionController(AdmissionConfig(thresholds=thresholds))
    orchestrator = Orchestrator(view, admission, None, "m", setup.config)

    async def one(i: int) -> list[StreamDelta] | BaseException:
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        req = ValidRequest(f"client-{i}", PROMPT, sampling, "", 0, "")
        out: list[StreamDelta] = []
        try:
            async for delta in orchestrator.generate(req, timeout_s=30):
                out.append(delta)
                if between is not None and len(out) == 1:
                    await between(view, directory)
        except Exception as e:
            return e
        return out

    got = await asyncio.gather(*(one(i) for i in range(requests)))
    await asyncio.sleep(0.02)
    await view.stop()
    assert orchestrator.inflight == 0 and orchestrator.running == 0
    for entry in view.entries.values():
        assert entry.reserved_decode_blocks == 0, entry.worker_id
    return list(got), orchestrator


def serve(setup: Setup, **kw: Any) -> tuple[list[list[StreamDelta] | BaseException], Any]:
    return asyncio.run(_serve(setup, **kw))


def tokens(got: list[StreamDelta] | BaseException) -> list[int]:
    assert isinstance(got, list), repr(got)
    assert got[-1].finish_reason is FinishReason.LENGTH
    assert got[-1].usage is not None and got[-1].usage.prompt_tokens == len(PROMPT)
    assert got[-1].usage.completion_tokens == MAX_TOKENS
    return [t for d in got for t in d.token_ids]


# ---- each token exactly once, on every retry path ------------------------------------------


def test_transfer_failure_after_the_first_token_retries_and_delivers_each_token_once() -> None:
    setup = Setup([FakePrefill("prefill-0")], [FakeDecode("decode-1", fail_pulls=1)])
    (got,), _ = serve(setup)
    assert tokens(got) == EXPECTED
    # the retry's own prefill must hand off whatever it samples: nothing ends it early
    retry = setup.prefill[0].prefills[1][0]
    assert retry.sampling.ignore_eos and retry.sampling.max_tokens >= 2


def test_decode_worker_draining_or_overloaded_at_submit_retries_on_the_other() -> None:
    for refusal in (WorkerDraining("decode-1 is draining"), WorkerOverloaded("full")):
        setup = Setup(
            [FakePrefill("prefill-0")],
            [FakeDecode("decode-1", refuse_with=[refusal]), FakeDecode("decode-2")],
        )
        (got,), _ = serve(setup)
        assert tokens(got) == EXPECTED
        assert len(setup.decode[1].submits) == 1, refusal


def test_prefill_worker_draining_overloaded_or_failing_moves_to_another() -> None:
    for failure in (WorkerDraining("x"), WorkerOverloaded("y"), StepFailed("engine step failed")):
        setup = Setup(
            [FakePrefill("prefill-0", fail_with=[failure]), FakePrefill("prefill-1")],
            [FakeDecode("decode-1")],
        )
        # both prefill workers are idle: the first pick is the lower id
        (got,), _ = serve(setup)
        assert tokens(got) == EXPECTED, failure
        assert len(setup.prefill[1].prefills) == 1
        # the same attempt on another prefill worker: same id (no `~N`), same decode worker
        first, second = setup.prefill[0].prefills[0][0], setup.prefill[1].prefills[0][0]
        assert second.request_id == first.request_id
        assert [c[0].request_id for c in setup.decode[0].submits] == [first.request_id]
        assert setup.prefill[1].aborts == [] and setup.decode[0].aborts == []
        assert got[-1].timings is not None and got[-1].timings.prefill_worker == "prefill-1"


def test_a_request_that_ends_on_its_first_token_releases_its_decode_reservation() -> None:
    setup = Setup([FakePrefill("prefill-0")], [FakeDecode("decode-1")])
    (got,), _ = serve(setup, max_tokens=1)  # serve asserts every reservation is released
    assert isinstance(got, list) and [t for d in got for t in d.token_ids] == EXPECTED[:1]
    assert got[-1].finish_reason is FinishReason.LENGTH and setup.decode[0].submits == []


def test_no_prefill_worker_left_after_the_first_token_resumes_on_the_decode_worker() -> None:
    setup = Setup([FakePrefill("prefill-0")], [FakeDecode("decode-1", fail_pulls=1)])

    async def prefill_gone(view: ClusterView, directory: StaticDirectory) -> None:
        view.avoid("prefill-0", 60)  # the hand-off fails next; no prefill worker remains

    (got,), _ = serve(setup, between=prefill_gone)
    assert tokens(got) == EXPECTED
    resumed = setup.decode[0].submits[-1][0]
    # the prompt, then the token already sent as its prior output, computed on the decode
    # worker, which samples the second token on (max_tokens counts the prior token)
    assert resumed.handle is None and resumed.first_token_id is None
    assert resumed.prompt_token_ids == PROMPT
    assert resumed.prior.token_ids == (EXPECTED[0],) and resumed.prior.text_chars == 1
    assert resumed.sampling.max_tokens == MAX_TOKENS


def test_decode_worker_lost_before_any_decoded_token_is_retried_on_another() -> None:
    setup = Setup(
        [FakePrefill("prefill-0")],
        [FakeDecode("decode-1", hang_after=0), FakeDecode("decode-2", used_blocks=5)],
        OrchestratorConfig(handoff_timeout_s=0.3, avoid_after_timeout_s=30),
    )
    (got,), _ = serve(setup)
    assert tokens(got) == EXPECTED
    assert len(setup.decode[1].submits) == 1


# ---- stage deadlines ------------------------------------------------------------------------


def test_a_decode_worker_that_goes_silent_mid_stream_ends_the_request_in_the_token_gap() -> None:
    setup = Setup(
        [FakePrefill("prefill-0")],
        [FakeDecode("decode-1", hang_after=2)],
        OrchestratorConfig(token_gap_timeout_s=0.3, migration_limit=0),  # (no migration)
    )
    t0 = time.monotonic()
    (got,), _ = serve(setup)
    assert time.monotonic() - t0 < 3
    assert isinstance(got, StreamCut) and got.tokens_delivered == 3, got
    assert isinstance(got.error, StageTimeout)
    failure = to_grpc_failure(got)
    assert failure.code.name == "UNAVAILABLE"
    assert "did not answer within 0.3s" in failure.message
    assert failure.message.endswith("(3 tokens delivered)")
    assert setup.decode[0].aborts  # what it still held is aborted


# ---- migration: a running request moves when its decode worker fails ----------------------


def test_a_request_whose_decode_worker_goes_silent_migrates_and_its_stream_goes_on() -> None:
    setup = Setup(
        [FakePrefill("prefill-0")],
        [FakeDecode("decode-1", hang_after=2), FakeDecode("decode-2", used_blocks=5)],
        OrchestratorConfig(token_gap_timeout_s=0.3),
    )
    (got,), orchestrator = serve(setup)
    assert tokens(got) == EXPECTED  # none lost, none repeated
    # the re-prefill computes the prompt + the tokens sent but the last on a prefill worker
    assert len(setup.prefill[0].prefills) == 2
    (again,) = setup.prefill[0].prefills[1]
    assert again.prompt_token_ids == (*PROMPT, *EXPECTED[:2])
    # decode-2 pulls that and continues after the client's last token, the two before it
    # its prior output (they count in max_tokens)
    (moved,) = (s[0] for s in setup.decode[1].submits)
    assert moved.prompt_token_ids == PROMPT and moved.sampling.max_tokens == MAX_TOKENS
    assert moved.prior.token_ids == tuple(EXPECTED[:2]) and moved.first_token_id == EXPECTED[2]
    assert moved.prior.text_chars == 3  # "a" from the prefill worker, "b" "b" from decode-1
    assert setup.decode[0].aborts  # what decode-1 still held is aborted
    assert orchestrator.metrics.migrations.labels("re-prefill")._value.get() == 1


def test_migration_with_no_prefill_worker_left_resumes_on_a_decode_worker_alone() -> None:
    setup = Setup(
        [FakePrefill("prefill-0")],
        [FakeDecode("decode-1", hang_after=2), FakeDecode("decode-2", used_blocks=5)],
        OrchestratorConfig(token_gap_timeout_s=0.3),
    )

    async def prefill_gone(view: ClusterView, directory: StaticDirectory) -> None:
        view.avoid("prefill-0", 60)

    (got,), orchestrator = serve(setup, between=prefill_gone)
    assert tokens(got) == EXPECTED
    (resumed,) = (s[0] for s in setup.decode[1].submits)
    assert resumed.handle is None and resumed.prior.token_ids == tuple(EXPECTED[:3])
    assert orchestrator.metrics.migrations.labels("resume")._value.get() == 1


def test_a_local_prefill_whose_decode_worker_goes_silent_resumes_after_its_tokens() -> None:
    # no prefill worker: decode-1 computes the request alone, streams 2 tokens, goes silent
    setup = Setup(
        [],
        [FakeDecode("decode-1", hang_after=2), FakeDecode("decode-2", used_blocks=5)],
        OrchestratorConfig(token_gap_timeout_s=0.3),
    )
    (got,), orchestrator = serve(setup)
    assert tokens(got) == EXPECTED
    (resumed,) = (s[0] for s in setup.decode[1].submits)
    assert resumed.handle is None and resumed.prior.token_ids == tuple(EXPECTED[:2])
    assert orchestrator.metrics.migrations.labels("resume")._value.get() == 1


def test_a_request_past_its_migration_limit_ends_unavailable_naming_the_tokens_delivered() -> None:
    setup = Setup(
        [FakePrefill("prefill-0")],
        [FakeDecode("decode-1", hang_after=1), FakeDecode("decode-2", hang_after=1)],
        OrchestratorConfig(token_gap_timeout_s=0.3, migration_limit=1),
    )
    (got,), orchestrator = serve(setup)
    # decode-1 sent one token after the first, decode-2 (the one migration) one more
    assert isinstance(got, StreamCut) and got.tokens_delivered == 3, got
    failure = to_grpc_failure(got)
    assert failure.code.name == "UNAVAILABLE" and failure.message.endswith("(3 tokens delivered)")
    assert orchestrator.metrics.migrations.labels("re-prefill")._value.get() == 1
    assert setup.decode[0].aborts and setup.decode[1].aborts


def test_a_prefill_worker_that_never_answers_ends_the_request_unavailable() -> None:
    setup = Setup(
        [FakePrefill("prefill-0", hang=True)],
        [FakeDecode("decode-1")],
        OrchestratorConfig(prefill_timeout_s=0.3),
    )
    (got,), _ = serve(setup)
    assert isinstance(got, StageTimeout), got
    assert isinstance(got, WorkerLost) and to_grpc_failure(got).code.name == "UNAVAILABLE"
    assert setup.prefill[0].aborts  # the worker is told to drop it


# ---- a burst spreads ------------------------------------------------------------------------


@pytest.mark.parametrize("requests", [12, 13])
def test_a_burst_splits_evenly_over_two_idle_decode_workers(requests: int) -> None:
    setup = Setup([FakePrefill("prefill-0")], [FakeDecode("decode-1"), FakeDecode("decode-2")])
    got, _ = serve(setup, requests=requests)
    assert all(tokens(g) == EXPECTED for g in got)
    placed = Counter({d.worker_id: len(d.submits) for d in setup.decode})
    assert abs(placed["decode-1"] - placed["decode-2"]) <= 1, placed
