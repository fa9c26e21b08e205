"""The request orchestrator: one request's path, top to bottom.

`Orchestrator.generate` serves one request that router/validation.py has checked:

1. Look up and admit: `_lookup` hashes the prompt's full blocks (vocabulary/block_hash.py)
   and asks the Redis index which worker caches the longest prefix (one round trip; Redis
   down means "no cache info", not failure); `_admit` then has the admission controller
   admit now, queue with a bounded wait, or reject early.
2. Place (`_place`): the least-cost prefill worker (cache-aware) and the least-loaded decode
   worker, or the decode worker alone when the local-prefill policy says so (conditional
   disaggregation: router/prefill_cost.py) or no prefill worker is left.
3. Prefill (`_prefill`): the prefill worker answers with the first token and a KV handle; the
   first token goes to the client at once (TTFT ends here).
4. Hand-off (`_hand_off`): the decode worker is asked to pull that KV and to continue after
   the first token.
5. Decode stream (`_decode`): its chunks come on this router's token channel to it
   (router/decode_channel.py: one Ray item per engine step for all of this router's requests
   on that worker), each within a stage deadline, until the finish reason.
6. Finish (`_finish`): on every exit, the admission reservation is released and the
   request's metrics are recorded (router/progress.py computes them).

Steps 2-5 are one attempt (`_serve`). A failed attempt releases its decode reservation and
aborts what its workers still hold (`_serve` the prefill lease; a prefill call cut short and
an unfinished decode stream abort themselves). The recovery policy (router/recovery.py, a
pure function) then decides: the same attempt on another prefill worker, a fresh attempt on
(if possible) other workers under a fresh worker-facing id, a resume on the decode worker
alone (prompt + first token), or failing with the typed error that router/errors.py maps to
a status. The orchestrator only carries the decision out. With tracing on, the steps are the
spans of the request's trace (router/request_spans.py draws the tree).
"""

from __future__ import annotations

import asyncio
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
from prefix_index.index import PrefixIndex
from prefix_index.types import PrefixMatch
from router import request_spans as tracing
from router.cluster_view import ClusterView, DecodeReservation
from router.errors import (
    StageTimeout,
    StreamCut,
    WorkerLost,
    is_actor_death,
    to_grpc_failure,
    unwrap,
)
from router.metrics import Arrivals, RouterMetrics
from router.placement import Placement, PlacementConfig, place
from router.prefill_cost import LocalPrefillConfig
from router.progress import RequestProgress, StreamDelta
from router.recovery import (
    Attempt,
    Decision,
    Fail,
    Failure,
    RecoveryLimits,
    Resume,
    Retry,
    RetryScope,
    Stage,
    decide,
    failure_of,
)
from router.validation import UnknownLora, ValidRequest
from router.worker_calls import cancel_remote, fire, within
from router.worker_requests import (
    handoff_request,
    handoff_sampling,
    local_request,
    prefill_request,
    resume_request,
)
from vocabulary.block_hash import hash_chain, hash_extra
from vocabulary.decode_api import DecodeRequest
from vocabulary.prefill_api import PrefillResult
from vocabulary.tracing import Span, SpanKind, TraceContext
from vocabulary.worker_api import RequestDeadlineExceeded

__all__ = ["Orchestrator", "OrchestratorConfig", "StreamDelta"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OrchestratorConfig:
    uncached_block_weight: float = 4.0
    """Placement: cost of one uncached prompt block vs one block of queued prefill work."""
    host_block_weight: float = 0.25
    """Placement: cost of one prompt block a worker holds in its host KV tier (an onboard)."""
    cold_lora_weight: float = 16.0
    """Placement: the cost (in blocks) of a worker that must first read the request's LoRA
    adapter into its cache (router/placement.py)."""
    local_prefill: LocalPrefillConfig = field(default_factory=LocalPrefillConfig)
    """Placement: when the decode worker prefills a prompt itself (router/prefill_cost.py)."""
    max_handoff_retries: int = 1
    """Fresh prefills after a failed hand-off (before the first decoded token)."""
    max_prefill_attempts: int = 3
    """Prefill workers tried when one is draining, overloaded, stopped, failing or dead."""
    migration_limit: int = 3
    """Times a running request moves to other workers when its decode worker dies, breaks
    its token channel or stops answering (its stream goes on, no token lost or repeated);
    past it the request ends with UNAVAILABLE naming the tokens delivered. 0: never."""
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

    def __post_init__(self) -> None:
        for name in ("max_handoff_retries", "migration_limit"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")


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
        self.arrived = Arrivals()
        """Every request that reached `generate`, and its prompt tokens (the planner's load)."""
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
        progress = RequestProgress(prompt_tokens=len(req.prompt_token_ids))
        self.arrived = self.arrived.plus(progress.prompt_tokens)
        self.view.request_arrived()
        client_id = req.request_id
        req = replace(req, request_id=f"{req.request_id}@{self._id_prefix}{next(self._seq)}")
        trace = tracing.request_trace(req, client_id)  # NO_TRACE unless this router traces
        if timeout_s is None:
            timeout_s = self.config.default_request_timeout_s
        deadline = time.time() + timeout_s
        match = self._lookup(req)
        areq = self._admission_request(req, match, timeout_s)
        self.inflight += 1
        self.metrics.inflight.set(self.inflight)
        admitted: Admission | None = None
        outcome = "error"
        try:
            if req.lora and not self.view.serves_lora(req.lora):
                raise UnknownLora(req.lora)
            admitted = await self._admit(areq, progress, trace)
            async for delta in self._serve(req, match, areq, progress, deadline, trace):
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
            self._finish(req.request_id, admitted, progress, outcome, trace)

    # ---- 1. admit ---------------------------------------------------------------------------

    def _lookup(self, req: ValidRequest) -> PrefixMatch:
        """The Redis prefix lookup of the prompt's hash chain, on the event loop: one loopback
        round trip, bounded by the index's socket timeout and then its circuit breaker. A
        worker thread (`asyncio.to_thread`) would add two thread hand-offs, each dearer on a
        busy machine than this call, which rarely blocks (docs/benchmarks.md, "Router
        overhead (CPU)")."""
        extra = hash_extra(self.model_id, req.cache_salt, req.lora)
        hashes = hash_chain(req.prompt_token_ids, self.view.block_size(), extra)
        if self.index is None or not hashes:
            return PrefixMatch(chain_length=len(hashes), available=self.index is not None)
        return self.index.lookup(hashes)

    def _admission_request(
        self, req: ValidRequest, match: PrefixMatch, timeout_s: float
    ) -> AdmissionRequest:
        best = max((w.num_blocks for w in match.workers), default=0)
        prompt_len = len(req.prompt_token_ids)
        return AdmissionRequest(
            request_id=req.request_id,
            prompt_tokens=prompt_len,
            uncached_prompt_tokens=max(prompt_len - best * self.view.block_size(), 0),
            max_tokens=req.sampling.max_tokens,
            tenant=req.tenant,
            priority=req.priority,
            deadline_ms=timeout_s * 1000,
        )

    async def _admit(
        self, areq: AdmissionRequest, progress: RequestProgress, trace: tracing.RequestTrace
    ) -> Admission:
        with trace.span(tracing.ADMISSION) as span:
            admitted = await self.admission.admit(areq, self._snapshot)
            span.set("pdserve.queued_ms", admitted.queued_ms)
        self.running += 1
        self.metrics.admission.labels("admit", "admitted").inc()
        progress.admitted(admitted.queued_ms)
        self.metrics.queue.observe(admitted.queued_ms / 1000)
        return admitted

    def _snapshot(self) -> ClusterSnapshot:
        # Admitted requests only: counting the queued ones (or the one being evaluated) would
        # make a queue block its own admission, and a limit of N admit N - 1.
        return self.view.admission_snapshot(self.admission.throughput.tokens_per_s, self.running)

    # ---- 2-5. the attempts ------------------------------------------------------------------

    async def _serve(
        self,
        req: ValidRequest,
        match: PrefixMatch,
        areq: AdmissionRequest,
        progress: RequestProgress,
        deadline: float | None,
        trace: tracing.RequestTrace,
    ) -> AsyncIterator[StreamDelta]:
        """Attempts (place → prefill → first token → hand-off → decode stream), until one
        finishes or the recovery policy fails the request."""
        block_size = self.view.block_size()
        decode_blocks = areq.kv_blocks(block_size)
        attempt = Attempt(base_id=req.request_id)
        for n in itertools.count(1):
            placement: Placement | None = None
            reservation: DecodeReservation | None = None
            # Set once the prefill worker holds the prompt's blocks: every failure from there,
            # including a client that goes away while the first token is being written, must
            # end it (else the blocks stay pinned until the lease expires).
            lease: PrefillResult | None = None
            try:
                with trace.span(tracing.PLACEMENT) as span:
                    placement = self._place(
                        attempt, match, req.lora, block_size, decode_blocks, progress
                    )
                    tracing.placed(span, placement, n)
                progress.placed(placement)
                self.metrics.observe_placement(placement)
                # Counted on the decode worker until its load reports show the request (its
                # first chunk), so a burst placed between two polls spreads over the workers.
                reservation = self.view.reserve_decode(placement.decode_worker_id, decode_blocks)
                wreq = replace(req, request_id=attempt.request_id)
                if placement.local_prefill:
                    with trace.span(tracing.DECODE, SpanKind.CLIENT) as span:
                        async for delta in self._decode_alone(
                            wreq, placement, progress, reservation, deadline, span
                        ):
                            yield delta
                    return
                with trace.span(tracing.PREFILL, SpanKind.CLIENT) as span:
                    lease = await self._prefill(wreq, placement, progress, deadline, span.carrier())
                    tracing.prefilled(span, lease)
                if not progress.sent_any:
                    yield progress.first_token_out(lease)
                    if lease.finish_reason is not None:
                        yield progress.final_delta(lease.finish_reason)
                        return
                with trace.span(tracing.DECODE, SpanKind.CLIENT) as span:
                    dreq = self._hand_off(wreq, lease, progress, deadline, span.carrier())
                    async for delta in self._decode(
                        placement, dreq, progress, reservation, self.config.handoff_timeout_s, span
                    ):
                        yield delta
                return
            except BaseException as e:
                if lease is not None:
                    self._abort_prefill(lease)
                failure = failure_of(e, placement, lease is not None, progress.decoded_tokens > 0)
                decision, attempt = self._recover(
                    failure, attempt, placement, match, req.lora, progress
                )
                if isinstance(decision, Fail):
                    if decision.error is failure.error:
                        raise
                    raise decision.error from None
            finally:
                if reservation is not None:
                    reservation.release()

    def _recover(
        self,
        failure: Failure,
        attempt: Attempt,
        placement: Placement | None,
        match: PrefixMatch,
        lora: str,
        progress: RequestProgress,
    ) -> tuple[Decision, Attempt]:
        """The recovery policy's decision on a failed attempt, and the attempt it makes next."""
        if failure.stage is Stage.PREFILL and failure.worker_id is not None:
            attempt = attempt.excluding_prefill(failure.worker_id)
        prefill_left = self.view.prefill_candidates(match, lora, attempt.excluded_prefill)
        snapshot = attempt.snapshot(progress.sent_any, len(prefill_left))
        limits = RecoveryLimits(
            self.config.max_handoff_retries,
            self.config.max_prefill_attempts,
            self.config.migration_limit,
        )
        decision = decide(failure, snapshot, limits)
        if isinstance(decision, Fail):
            return decision, attempt
        assert placement is not None  # a placement failure is never retried
        if isinstance(decision, Retry) and decision.scope is RetryScope.PREFILL_WORKER:
            worker = min(prefill_left, key=lambda c: c.queued_prefill_tokens).worker_id
            return decision, attempt.another_prefill_worker(
                replace(placement, prefill_worker_id=worker)
            )
        excluded = attempt.excluded_decode | {placement.decode_worker_id}
        if not self.view.decode_candidates(match, lora, excluded):
            excluded = frozenset()  # the only decode worker: try it again
        resume = isinstance(decision, Resume)
        migration = failure.stage in (Stage.DECODE, Stage.LOCAL)
        attempt = attempt.fresh(excluded, resume, migration)
        if migration:
            progress.migrations += 1
            self.metrics.migrations.labels("resume" if resume else "re-prefill").inc()
        log.warning(
            "request %s: %s failed on %s (%s); %s after %d tokens", attempt.request_id,
            "decode" if migration else "hand-off", failure.worker_id, failure.error,
            "resuming on a decode worker" if resume else "re-prefilling",
            progress.completion_tokens,
        )  # fmt: skip
        return decision, attempt

    # ---- 2. place ---------------------------------------------------------------------------

    def _place(
        self,
        attempt: Attempt,
        match: PrefixMatch,
        lora: str,
        block_size: int,
        decode_blocks: int,
        progress: RequestProgress,
    ) -> Placement:
        """The attempt's workers: fixed by a retry on another prefill worker, else placed by
        cost over the workers it has not failed on; once the first token is out never a local
        prefill (the decode worker alone must resume after that token: `Resume`)."""
        if attempt.placement is not None:
            return attempt.placement
        prefill = [] if attempt.resume else self.view.prefill_candidates(
            match, lora, attempt.excluded_prefill
        )  # fmt: skip
        c, local = self.config, self.config.local_prefill
        config = PlacementConfig(
            c.uncached_block_weight, self.admission.thresholds.local_prefill_threshold_tokens,
            c.host_block_weight, c.cold_lora_weight, local.kind, local.cost, local.stall_weight,
            allow_local=not progress.sent_any,
        )  # fmt: skip
        decode = self.view.decode_candidates(match, lora, attempt.excluded_decode)
        return place(progress.prompt_tokens, block_size, prefill, decode, config, decode_blocks)

    # ---- 3. prefill -------------------------------------------------------------------------

    async def _prefill(
        self,
        req: ValidRequest,
        placement: Placement,
        progress: RequestProgress,
        deadline: float | None,
        trace: TraceContext | None,
    ) -> PrefillResult:
        """The prompt on the placed prefill worker, within the prefill stage deadline. A call
        cut short (a client cancel, a deadline) is cancelled and the worker told to drop the
        request: an abort that reaches it while the prompt waits in its engine frees the
        blocks but does not end the call. A dead worker is marked dead."""
        worker_id = placement.prefill_worker_id
        entry = self.view.get(worker_id) if worker_id is not None else None
        if worker_id is None or entry is None:
            raise WorkerLost("no prefill worker could take the request")
        # A retry's prefill only rebuilds the KV: its first token is dropped (the client has
        # one), so it must hand off whatever it samples.
        if not progress.sent_any:
            preq = prefill_request(req, req.sampling, deadline, trace=trace)
        else:  # the client's tokens but the last follow the prompt (a migration's)
            preq = prefill_request(
                req, handoff_sampling(req.sampling), deadline, progress.prior(with_last=False),
                trace,
            )  # fmt: skip
        dispatched = entry.dispatch(placement.uncached_tokens)
        ref = entry.handle.prefill.remote(preq)
        try:
            result: PrefillResult = await self._within(
                ref, self.config.prefill_timeout_s, deadline, "prefill", worker_id, progress
            )
        except BaseException as e:
            err = unwrap(e)
            if isinstance(e, asyncio.CancelledError) or isinstance(
                err, (StageTimeout, RequestDeadlineExceeded)
            ):
                cancel_remote(ref)
                fire(entry.handle.abort.remote(req.request_id))
            elif is_actor_death(err):
                self.view.mark_dead(worker_id)
            raise
        finally:
            entry.undispatch(dispatched)
        progress.prefilled(worker_id, result)
        computed = result.num_prompt_tokens - result.num_cached_prompt_tokens
        self.admission.throughput.observe(worker_id, computed, result.prefill_s)
        return result

    # ---- 4. hand-off ------------------------------------------------------------------------

    def _hand_off(
        self,
        req: ValidRequest,
        lease: PrefillResult,
        progress: RequestProgress,
        deadline: float | None,
        trace: TraceContext | None,
    ) -> DecodeRequest:
        """The decode request that pulls the lease's KV and continues after the client's
        last token (a retry's prefill sampled another one; it is dropped)."""
        if lease.handle is None:  # never with a hand-off sampling; guard the stream
            raise WorkerLost(f"prefill worker {lease.worker_id} returned no KV handle")
        assert progress.sent_any
        return handoff_request(
            req, lease.handle, progress.last_token, deadline, progress.prior(with_last=False),
            trace,
        )  # fmt: skip

    def _abort_prefill(self, lease: PrefillResult) -> None:
        entry = self.view.get(lease.worker_id)
        if entry is not None:
            fire(entry.handle.abort.remote(lease.request_id))

    # ---- 5. decode stream -------------------------------------------------------------------

    def _decode_alone(
        self,
        req: ValidRequest,
        placement: Placement,
        progress: RequestProgress,
        reservation: DecodeReservation,
        deadline: float | None,
        span: Span,
    ) -> AsyncIterator[StreamDelta]:
        """The decode worker computes the request alone: a local prefill, or (tokens already
        out, no prefill worker left) a resume after them."""
        if not progress.sent_any:
            dreq = local_request(req, deadline, span.carrier())
        else:
            dreq = resume_request(req, progress.prior(with_last=True), deadline, span.carrier())
        first_chunk_s = self.config.prefill_timeout_s + self.config.handoff_timeout_s
        return self._decode(placement, dreq, progress, reservation, first_chunk_s, span)

    async def _decode(
        self,
        placement: Placement,
        dreq: DecodeRequest,
        progress: RequestProgress,
        reservation: DecodeReservation,
        first_timeout_s: float,
        span: Span,
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
        phase = tracing.first_phase(span, dreq, worker_id)  # the hand-off, then the stream
        chunk, error = None, None
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
                if stage == "hand-off":
                    phase = tracing.first_chunk(phase, span, chunk)
                reservation.started()  # its load reports count it from the next one on
                timeout, stage = self.config.token_gap_timeout_s, "token stream"
                progress.chunk(chunk)
                if chunk.transfer_s:
                    self.metrics.transfer.observe(chunk.transfer_s)
                finished = chunk.finish_reason is not None
                yield progress.chunk_delta(chunk)
        except BaseException as e:
            error = e
            raise
        finally:
            tracing.stream_ended(phase, progress, chunk, error)
            stream.close()
            if not finished:
                fire(entry.handle.abort.remote(dreq.request_id))

    async def _within(
        self,
        awaitable: Any,
        stage_s: float,
        deadline: float | None,
        stage: str,
        worker_id: str,
        progress: RequestProgress,
    ) -> Any:
        """Await a worker within a stage deadline (router/worker_calls.py); placement avoids
        a worker that misses one for `avoid_after_timeout_s`."""
        try:
            return await within(
                awaitable, stage_s, deadline, stage, worker_id, progress.completion_tokens
            )
        except StageTimeout:
            self.view.avoid(worker_id, self.config.avoid_after_timeout_s)
            raise

    # ---- 6. finish --------------------------------------------------------------------------

    def _finish(
        self,
        request_id: str,
        admitted: Admission | None,
        progress: RequestProgress,
        outcome: str,
        trace: tracing.RequestTrace,
    ) -> None:
        self.inflight -= 1
        self.metrics.inflight.set(self.inflight)
        if admitted is not None:
            self.running -= 1
            self.admission.release(request_id, generated_tokens=progress.completion_tokens)
        record = progress.record()
        trace.finish(outcome, record, progress)
        self.metrics.observe_request(
            outcome, record.ttft_s, record.tpot_s, record.e2e_s, record.first_token_worker,
            record.decode_worker, progress.completion_tokens,
        )  # fmt: skip
        if outcome == "ok":
            cached = record.cached_prompt_tokens
            self.metrics.cached_tokens.labels("cached").inc(cached)
            self.metrics.cached_tokens.labels("computed").inc(progress.prompt_tokens - cached)
