"""The request orchestrator: hash → admit → place → prefill → hand-off → decode stream.

One `generate` call per request (DESIGN.md lifecycle steps 2-8, after validation):

1. Hash the prompt's full blocks (engine/block_hash.py) and ask the Redis index which worker
   caches the longest prefix (one round trip; Redis down means "no cache info", not failure).
2. Admit (admission controller: admit now, queue with a bounded wait, or reject early).
3. Place: least-cost prefill worker (cache-aware) and least-loaded decode worker, or the
   decode worker alone when the uncached remainder is short (conditional disaggregation).
4. Prefill: the first token goes to the client at once (TTFT ends here) with the KV handle.
5. Decode: the decode worker pulls the KV and streams the rest, on this router's token
   channel to it (router/decode_channel.py: one Ray item per engine step for all of this
   router's requests on that worker).

Retries: a prefill worker that is draining, overloaded or dead is replaced by another; a
hand-off that fails before the first decoded token (transfer error, lease expired, decode
worker lost) is retried once with a fresh prefill on (if possible) other workers, under a
fresh worker-facing request id, and the decode continues from the first token already sent.
Every exit path releases the admission reservation and aborts whatever the workers still hold
for the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from admission.controller import AdmissionController
from admission.decision import Admission, AdmissionRejected
from admission.snapshot import AdmissionRequest, ClusterSnapshot
from decode_worker.api import DecodeRequest, TokenChunk
from engine.block_hash import BlockHash, hash_chain, hash_extra
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from kv_transfer.errors import TransferError
from prefill_worker.api import PrefillRequest, PrefillResult
from prefix_index.index import PrefixIndex
from prefix_index.types import PrefixMatch
from router.cluster_view import ClusterView, DecodeReservation
from router.errors import (
    StageTimeout,
    StreamCut,
    WorkerLost,
    is_actor_death,
    to_grpc_failure,
    unwrap,
)
from router.metrics import RouterMetrics
from router.placement import Placement, PlacementConfig, place
from router.validation import ValidRequest
from worker_runtime.api import (
    RequestDeadlineExceeded,
    StepFailed,
    WorkerDraining,
    WorkerOverloaded,
    WorkerStopped,
)

log = logging.getLogger(__name__)

DEADLINE_GRACE_S = 1.0
"""How long past a request's deadline the router waits for the worker's own deadline error."""
_PREFILL_RETRYABLE: tuple[type[BaseException], ...] = (
    WorkerDraining,
    WorkerOverloaded,
    WorkerStopped,
    StepFailed,
)
"""Errors of a worker call that another worker may not have."""


@dataclass(frozen=True)
class OrchestratorConfig:
    uncached_block_weight: float = 4.0
    """Placement: cost of one uncached prompt block vs one block of queued prefill work."""
    max_handoff_retries: int = 1
    """Fresh prefills after a failed hand-off (before the first decoded token)."""
    max_prefill_attempts: int = 3
    """Prefill workers tried when one is draining, overloaded, stopped, failing or dead."""
    default_request_timeout_s: float = 1800.0
    """Deadline of a request whose client sets none (so no request waits forever)."""
    prefill_timeout_s: float = 120.0
    """Stage deadline: the prefill worker's answer (queue + prompt). Past it the request
    ends with UNAVAILABLE and the worker is avoided for `avoid_after_timeout_s`."""
    handoff_timeout_s: float = 90.0
    """Stage deadline: from the decode submit to its first chunk (KV pull, joining the batch;
    for a local prefill, plus `prefill_timeout_s`)."""
    token_gap_timeout_s: float = 30.0
    """Stage deadline: the longest gap between two chunks of a stream."""
    avoid_after_timeout_s: float = 30.0
    """How long placement avoids a worker that missed a stage deadline (the controller's
    progress check replaces it if it is stuck)."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    transferred_prompt_tokens: int


@dataclass(frozen=True)
class Timings:
    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float
    prefill_worker: str
    decode_worker: str
    local_prefill: bool


@dataclass(frozen=True)
class StreamDelta:
    """New tokens for the client; the last one carries finish reason, usage and timings."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None


@dataclass
class _Progress:
    """What one request has done so far (for timings, usage and retries)."""

    t0: float
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    first_token_id: int | None = None
    first_logprob: float | None = None
    decoded_tokens: int = 0
    """Tokens streamed from a decode worker (after the first)."""
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    cached_prompt_tokens: int = 0
    transferred_prompt_tokens: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    local_prefill: bool = False
    tried_prefill: set[str] = field(default_factory=set)
    tried_decode: set[str] = field(default_factory=set)

    def tokens_out(self, n: int) -> None:
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.completion_tokens += n


class Orchestrator:
    def __init__(
        self,
        view: ClusterView,
        admission: AdmissionController,
        index: PrefixIndex | None,
        model_id: str,
        config: OrchestratorConfig | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.view = view
        self.admission = admission
        self.index = index
        self.model_id = model_id
        self.config = config or OrchestratorConfig()
        self.metrics = metrics or RouterMetrics()
        self.inflight = 0
        """Requests inside the router: queued for admission, admitted, or streaming."""
        self.running = 0
        """Admitted requests not yet finished (what the in-flight admission limit counts)."""
        self._id_prefix = uuid.uuid4().hex[:8] + "."
        self._seq = itertools.count()

    # ---- the request ------------------------------------------------------------------------

    async def generate(
        self, req: ValidRequest, timeout_s: float | None = None
    ) -> AsyncGenerator[StreamDelta, None]:
        """Serve one validated request; raises typed errors (mapped in router/errors.py).

        Admission and the workers see the request under an id of this router's own (the
        client's id plus a per-router, per-request suffix): clients may reuse ids, and two
        router replicas may serve the same id at once, without their requests colliding
        in a worker's streams or aborting each other.
        """
        progress = _Progress(t0=time.perf_counter())
        self.view.request_arrived()
        req = replace(req, request_id=f"{req.request_id}@{self._id_prefix}{next(self._seq)}")
        if timeout_s is None:
            timeout_s = self.config.default_request_timeout_s
        deadline = time.time() + timeout_s
        block_size = self.view.block_size()
        hashes = hash_chain(
            req.prompt_token_ids, block_size, hash_extra(self.model_id, req.cache_salt)
        )
        match = self._lookup(hashes)
        best = max((w.num_blocks for w in match.workers), default=0)
        prompt_len = len(req.prompt_token_ids)
        areq = AdmissionRequest(
            request_id=req.request_id,
            prompt_tokens=prompt_len,
            uncached_prompt_tokens=max(prompt_len - best * block_size, 0),
            max_tokens=req.sampling.max_tokens,
            tenant=req.tenant,
            priority=req.priority,
            deadline_ms=timeout_s * 1000,
        )
        self.inflight += 1
        self.metrics.inflight.set(self.inflight)
        admitted: Admission | None = None
        outcome = "error"
        try:
            admitted = await self.admission.admit(areq, self._snapshot)
            self.running += 1
            self.metrics.admission.labels("admit", "admitted").inc()
            progress.queue_ms = admitted.queued_ms
            self.metrics.queue.observe(admitted.queued_ms / 1000)
            async for delta in self._serve(req, match, areq, progress, deadline):
                yield delta
            outcome = "ok"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except BaseException as e:
            outcome = to_grpc_failure(e).outcome
            if isinstance(e, AdmissionRejected):
                self.metrics.admission.labels("reject", e.reason.value).inc()
            if progress.completion_tokens and isinstance(e, Exception):
                raise StreamCut(unwrap(e), progress.completion_tokens) from e
            raise
        finally:
            self.inflight -= 1
            self.metrics.inflight.set(self.inflight)
            if admitted is not None:
                self.running -= 1
                self.admission.release(req.request_id, generated_tokens=progress.completion_tokens)
            self._observe(progress, outcome)

    def _snapshot(self) -> ClusterSnapshot:
        # Admitted requests only: counting the queued ones (or the one being evaluated) would
        # make a queue block its own admission, and a limit of N admit N - 1.
        return self.view.admission_snapshot(self.admission.throughput.tokens_per_s, self.running)

    def _lookup(self, hashes: list[BlockHash]) -> PrefixMatch:
        """The Redis prefix lookup, on the event loop: one loopback round trip (~0.2 ms idle),
        bounded by the index's socket timeout and then its circuit breaker. A worker thread
        (`asyncio.to_thread`) cost two thread hand-offs, 0.5-15 ms each on a busy 2-core
        machine (benchmarks/bench_router.py), for a call that rarely blocks."""
        if self.index is None or not hashes:
            return PrefixMatch(chain_length=len(hashes), available=self.index is not None)
        return self.index.lookup(hashes)

    async def _serve(
        self,
        req: ValidRequest,
        match: PrefixMatch,
        areq: AdmissionRequest,
        progress: _Progress,
        deadline: float | None,
    ) -> AsyncIterator[StreamDelta]:
        block_size = self.view.block_size()
        prompt_len = len(req.prompt_token_ids)
        handoff_failures = 0
        attempt_base_id = req.request_id
        while True:
            first_out = progress.first_token_id is not None
            placement = place(
                prompt_len,
                block_size,
                self.view.prefill_candidates(match, frozenset(progress.tried_prefill)),
                self.view.decode_candidates(match, frozenset(progress.tried_decode)),
                PlacementConfig(
                    self.config.uncached_block_weight,
                    # once the first token is out, a local prefill must resume after it
                    self.admission.thresholds.local_prefill_threshold_tokens
                    if not first_out
                    else -1,
                ),
                needed_decode_blocks=areq.kv_blocks(block_size),
            )
            progress.decode_worker = placement.decode_worker_id
            # Counted on the decode worker until its load reports show the request (its
            # first chunk), so a burst placed between two polls spreads over the workers.
            reservation = self.view.reserve_decode(
                placement.decode_worker_id, areq.kv_blocks(block_size)
            )
            try:
                if placement.local_prefill:
                    if first_out:  # no prefill worker left: the decode worker resumes
                        dreq = _resume_request(req, progress, deadline)
                    else:
                        progress.local_prefill = True
                        dreq = _decode_request(req, None, None, deadline)
                    first_timeout = self.config.prefill_timeout_s + self.config.handoff_timeout_s
                    async for delta in self._decode(
                        placement, dreq, progress, prompt_len, reservation, first_timeout
                    ):
                        yield delta
                    return
                # A retry's prefill only rebuilds the KV: its first token is dropped (the
                # client has one), so it must hand off whatever it samples.
                preq_sampling = _handoff_sampling(req.sampling) if first_out else req.sampling
                result = await self._prefill(req, preq_sampling, placement, match, progress,
                                             deadline)  # fmt: skip
            except BaseException:
                reservation.release()
                raise
            # From here the prefill worker holds the prompt's blocks under a lease: every exit,
            # including a client that goes away while the first token is being written,
            # must end it (else the blocks stay pinned until the lease expires).
            try:
                if progress.first_token_id is None:
                    progress.first_token_id = result.first_token_id
                    progress.first_logprob = result.first_logprob
                    progress.cached_prompt_tokens = result.num_cached_prompt_tokens
                    progress.tokens_out(1)
                    yield StreamDelta(
                        (result.first_token_id,),
                        result.first_text,
                        (result.first_logprob,) if result.first_logprob is not None else None,
                    )
                    if result.finish_reason is not None:
                        yield self._final(progress, result.finish_reason, prompt_len)
                        return
                if result.handle is None:  # never with a hand-off sampling; guard the stream
                    raise WorkerLost(f"prefill worker {result.worker_id} returned no KV handle")
                dreq = _decode_request(req, result, progress, deadline)
                async for delta in self._decode(
                    placement, dreq, progress, prompt_len, reservation,
                    self.config.handoff_timeout_s,
                ):  # fmt: skip
                    yield delta
                return
            except BaseException as e:
                reservation.release()
                err = unwrap(e)
                self._abort_prefill(result)
                if (
                    not _retryable(err)
                    or progress.decoded_tokens > 0
                    or handoff_failures >= self.config.max_handoff_retries
                ):
                    raise
                handoff_failures += 1
                # A fresh id towards the workers: the failed attempt's state there (a decode
                # reservation, a prefill lease) ends at its own pace, by the aborts sent above,
                # and must not collide with the retry's.
                req = replace(req, request_id=f"{attempt_base_id}~{handoff_failures}")
                progress.tried_decode.add(placement.decode_worker_id)
                if not self.view.decode_candidates(match, frozenset(progress.tried_decode)):
                    progress.tried_decode.clear()  # the only decode worker: try it again
                log.warning("request %s: hand-off failed (%s); re-prefilling", req.request_id, err)

    async def _prefill(
        self,
        req: ValidRequest,
        sampling: SamplingParams,
        placement: Placement,
        match: PrefixMatch,
        progress: _Progress,
        deadline: float | None,
    ) -> PrefillResult:
        """Prefill on the placed worker, moving to another if it is draining, full, stopped,
        failing or dead."""
        worker_id = placement.prefill_worker_id
        for attempt in range(self.config.max_prefill_attempts):
            if worker_id is None:
                break
            entry = self.view.get(worker_id)
            if entry is None:
                break
            entry.dispatched_prefill_tokens += placement.uncached_tokens
            preq = PrefillRequest(
                request_id=req.request_id,
                prompt_token_ids=req.prompt_token_ids,
                sampling=sampling,
                cache_salt=req.cache_salt,
                arrival_time=time.time(),
                deadline=deadline,
            )
            ref = entry.handle.prefill.remote(preq)
            try:
                result: PrefillResult = await self._within(
                    ref, self.config.prefill_timeout_s, deadline, "prefill", worker_id, progress
                )
            except BaseException as e:
                # Cancel the call itself too (a client cancel, a stage deadline): an abort
                # that reaches the worker while the prompt waits in its engine frees the
                # blocks but does not end the call.
                err = unwrap(e) if isinstance(e, Exception) else e
                if isinstance(e, asyncio.CancelledError) or isinstance(
                    err, (StageTimeout, RequestDeadlineExceeded)
                ):
                    _cancel_remote(ref)
                    _fire(entry.handle.abort.remote(req.request_id))
                    raise
                dead = is_actor_death(err)
                if dead:
                    self.view.mark_dead(worker_id)
                if not (dead or isinstance(err, _PREFILL_RETRYABLE)):
                    raise err from None
                progress.tried_prefill.add(worker_id)
                candidates = self.view.prefill_candidates(match, frozenset(progress.tried_prefill))
                if not candidates or attempt + 1 >= self.config.max_prefill_attempts:
                    raise WorkerLost(f"prefill worker {worker_id}: {err}") from None
                worker_id = min(candidates, key=lambda c: c.queued_prefill_tokens).worker_id
                continue
            finally:
                entry.dispatched_prefill_tokens = max(
                    entry.dispatched_prefill_tokens - placement.uncached_tokens, 0
                )
            progress.prefill_worker = worker_id
            progress.prefill_ms = result.prefill_s * 1000
            computed = result.num_prompt_tokens - result.num_cached_prompt_tokens
            self.admission.throughput.observe(worker_id, computed, result.prefill_s)
            return result
        raise WorkerLost("no prefill worker could take the request")

    async def _decode(
        self,
        placement: Placement,
        dreq: DecodeRequest,
        progress: _Progress,
        prompt_len: int,
        reservation: DecodeReservation,
        first_timeout_s: float,
    ) -> AsyncIterator[StreamDelta]:
        """Submit the request on this router's token channel to the decode worker and read its
        chunks off the channel (one Ray item per engine step for all of this router's
        requests there, demultiplexed by the channel's reader). The first chunk must come
        within `first_timeout_s`, each later one within `token_gap_timeout_s`."""
        entry = self.view.get(placement.decode_worker_id)
        if entry is None:
            raise WorkerLost(f"decode worker {placement.decode_worker_id} left the cluster")
        worker_id = entry.worker_id
        deadline = dreq.deadline
        stream = self.view.decode_channel(entry).open_request(dreq.request_id)
        finished = False
        try:
            try:
                await self._within(
                    stream.submit(dreq), self.config.token_gap_timeout_s, deadline,
                    "decode submit", worker_id, progress,
                )  # fmt: skip
            except Exception as e:
                if is_actor_death(unwrap(e)):
                    self.view.mark_dead(worker_id)
                raise
            timeout, stage = first_timeout_s, "hand-off"
            while not finished:
                chunk = await self._within(
                    stream.next(), timeout, deadline, stage, worker_id, progress
                )
                reservation.release()  # the worker's own load reports count it from here
                timeout, stage = self.config.token_gap_timeout_s, "token stream"
                delta = self._chunk_delta(chunk, progress, prompt_len)
                finished = chunk.finish_reason is not None
                yield delta
        finally:
            stream.close()
            if not finished:
                _fire(entry.handle.abort.remote(dreq.request_id))

    async def _within(
        self,
        awaitable: Any,
        stage_s: float,
        deadline: float | None,
        stage: str,
        worker_id: str,
        progress: _Progress,
    ) -> Any:
        """Await a worker within a stage deadline (and the request's own deadline, which the
        worker enforces itself: the router allows it `DEADLINE_GRACE_S` to say so)."""
        limit = stage_s
        request_bound = False
        if deadline is not None:
            remaining = deadline - time.time() + DEADLINE_GRACE_S
            if remaining < limit:
                limit, request_bound = max(remaining, 0.0), True
        try:
            return await asyncio.wait_for(awaitable, limit)
        except TimeoutError:
            if request_bound:
                raise RequestDeadlineExceeded(f"request deadline passed in {stage}") from None
            self.view.avoid(worker_id, self.config.avoid_after_timeout_s)
            raise StageTimeout(
                f"{stage}: worker {worker_id} did not answer within {stage_s:g}s "
                f"({progress.completion_tokens} tokens delivered)"
            ) from None

    def _chunk_delta(self, chunk: TokenChunk, progress: _Progress, prompt_len: int) -> StreamDelta:
        if chunk.transfer_s:
            progress.transfer_ms = chunk.transfer_s * 1000
            progress.transferred_prompt_tokens = chunk.num_transferred_tokens
            self.metrics.transfer.observe(chunk.transfer_s)
        if progress.local_prefill and progress.first_token_at is None:
            progress.prefill_ms = chunk.prefill_s * 1000
            progress.cached_prompt_tokens = chunk.num_cached_prompt_tokens
        if chunk.token_ids:
            progress.tokens_out(len(chunk.token_ids))
            if not progress.local_prefill:
                progress.decoded_tokens += len(chunk.token_ids)
        if chunk.finish_reason is None:
            return StreamDelta(chunk.token_ids, chunk.text, chunk.logprobs)
        final = self._final(progress, chunk.finish_reason, prompt_len)
        return StreamDelta(
            chunk.token_ids, chunk.text, chunk.logprobs, final.finish_reason, final.usage,
            final.timings,
        )  # fmt: skip

    def _final(self, progress: _Progress, reason: FinishReason, prompt_len: int) -> StreamDelta:
        now = time.perf_counter()
        first = progress.first_token_at or now
        last = progress.last_token_at or now
        n = progress.completion_tokens
        timings = Timings(
            queue_ms=progress.queue_ms,
            prefill_ms=progress.prefill_ms,
            transfer_ms=progress.transfer_ms,
            ttft_ms=(first - progress.t0) * 1000,
            tpot_ms=(last - first) * 1000 / (n - 1) if n > 1 else 0.0,
            e2e_ms=(now - progress.t0) * 1000,
            prefill_worker=progress.prefill_worker,
            decode_worker=progress.decode_worker,
            local_prefill=progress.local_prefill,
        )
        usage = Usage(
            prompt_tokens=prompt_len,
            completion_tokens=n,
            cached_prompt_tokens=progress.cached_prompt_tokens,
            transferred_prompt_tokens=progress.transferred_prompt_tokens,
        )
        return StreamDelta((), "", None, reason, usage, timings)

    def _abort_prefill(self, result: PrefillResult) -> None:
        entry = self.view.get(result.worker_id)
        if entry is not None:
            _fire(entry.handle.abort.remote(result.request_id))

    def _observe(self, progress: _Progress, outcome: str) -> None:
        now = time.perf_counter()
        ttft = progress.first_token_at - progress.t0 if progress.first_token_at else None
        tpot = None
        n = progress.completion_tokens
        if progress.first_token_at and progress.last_token_at and n > 1:
            tpot = (progress.last_token_at - progress.first_token_at) / (n - 1)
        first_worker = progress.decode_worker if progress.local_prefill else progress.prefill_worker
        self.metrics.observe_request(
            outcome, ttft, tpot, now - progress.t0, first_worker, progress.decode_worker
        )
        if outcome == "ok":
            self.metrics.cached_tokens.labels("cached").inc(progress.cached_prompt_tokens)


def _decode_request(
    req: ValidRequest,
    result: PrefillResult | None,
    progress: _Progress | None,
    deadline: float | None,
) -> DecodeRequest:
    return DecodeRequest(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=req.sampling,
        cache_salt=req.cache_salt,
        handle=result.handle if result is not None else None,
        first_token_id=progress.first_token_id if progress is not None else None,
        first_logprob=progress.first_logprob if progress is not None else None,
        arrival_time=time.time(),
        deadline=deadline,
    )


def _resume_request(
    req: ValidRequest, progress: _Progress, deadline: float | None
) -> DecodeRequest:
    """The rest of a request whose first token is out, computed on the decode worker alone
    (no prefill worker left): prompt + that token is prefilled there and it samples the
    second token on, so the client sees each token once."""
    assert progress.first_token_id is not None
    return DecodeRequest(
        request_id=req.request_id,
        prompt_token_ids=(*req.prompt_token_ids, progress.first_token_id),
        sampling=replace(req.sampling, max_tokens=req.sampling.max_tokens - 1),
        cache_salt=req.cache_salt,
        handle=None,
        first_token_id=None,
        first_logprob=None,
        arrival_time=time.time(),
        deadline=deadline,
    )


def _handoff_sampling(sampling: SamplingParams) -> SamplingParams:
    """Sampling for a retry's prefill: nothing ends the request on its first token (that
    token is dropped; the KV must be handed off)."""
    return replace(
        sampling,
        ignore_eos=True,
        stop=(),
        stop_token_ids=(),
        max_tokens=max(sampling.max_tokens, 2),
    )


def _retryable(err: BaseException) -> bool:
    """A hand-off failure that a fresh prefill on other workers may fix."""
    return isinstance(err, (TransferError, WorkerLost, *_PREFILL_RETRYABLE)) or is_actor_death(err)


def _cancel_remote(ref: Any) -> None:
    """Cancel a Ray call (an ObjectRef or a streaming generator), best effort."""
    import ray

    with contextlib.suppress(Exception):
        ray.cancel(ref)


def _fire(ref: Any) -> None:
    """A best-effort call (an abort): Ray runs it whether or not anyone awaits the result,
    and its failure (the worker is gone) changes nothing for the caller."""
    del ref
