"""The decode worker: a Ray actor that pulls a prompt's KV and streams the generated tokens.

Lifecycle of a request in this worker (the router's Hand-off and Decode stream steps,
router/orchestrator.py):

1. `submit(req, channel_id)` arrives with a `KVHandle` (disaggregated) or without one (local
   prefill: conditional disaggregation or colocated serving). It is accepted or refused at
   once (draining, full, bad input); the rest runs as the request's pipeline task.
2. Pulled requests: the worker makes sure it has a handshake with the prefill peer,
   allocates destination blocks (reusing blocks it already caches for the same prefix; those
   are not transferred), and submits the pull to its `DecodeEndpoint` (in-flight budget,
   deadline). Completion notifies the prefill worker, which ends its lease.
3. Once the KV has landed the request joins the running batch (in-flight batching) with the
   first token the prefill worker sampled; local-prefill requests join the waiting queue.
4. Tokens go to the caller's token channel (decode_worker/channel.py): one batch per engine
   step for all of that caller's requests, read by its one `subscribe` stream, until a stop
   condition, the deadline, or an abort ends the request with a last item. `generate(req)`
   is the same pipeline on a channel of its own (one streaming call per request).
5. Finished blocks stay in the pool as evictable prefix-cache entries (KV events go to
   Redis).

Failure paths free everything: a transfer that fails or expires frees its destination blocks
(the endpoint's outcome says when they are safe to reuse — never before a read that might
still write into them has ended); a cancelled `generate`, a deadline or an error aborts the
request in the engine, or cancels its transfer and lets the outcome free the blocks.
`abort(request_id)` takes the same paths (at whatever stage the request is) and ends the
request with a last chunk whose finish reason is ABORT. An abort that comes before its
`submit` or `generate` call (Ray does not order an async actor's calls) is remembered
(worker_runtime/early_aborts.py): the call, if it still comes, is accepted and its request
ends at once with that ABORT chunk, before it pulls, allocates or computes anything. A
channel whose subscriber is gone for `CHANNEL_ORPHAN_S` aborts its requests.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

from decode_worker.channel import ChannelRegistry, OutputChannel, RequestSink
from decode_worker.peer_locks import PeerLocks
from engine.core.engine import LLMEngine
from engine.kv.block_pool import NoFreeBlocksError
from kv_transfer.config import KVTransferConfig
from kv_transfer.decode_endpoint import DecodeEndpoint
from kv_transfer.manager import TransferOutcome, TransferState
from vocabulary.decode_api import ChannelInfo, ChannelItem, ChunkError, DecodeRequest, TokenChunk
from vocabulary.engine_io import FinishReason, TransferAllocation
from vocabulary.kv_handle import KVHandle
from vocabulary.tracing import (
    FLUSH_AFTER_S,
    NO_SPAN,
    DeferredSpans,
    Span,
    SpanKind,
    open_span,
    quietly,
)
from vocabulary.transfer_errors import PeerLost, TransferCancelled
from vocabulary.transfer_load import TransferLoad, TransferStats
from vocabulary.worker_api import (
    RequestAborted,
    WorkerLoad,
    WorkerOverloaded,
    actor_name_for,
)
from worker_runtime.early_aborts import EarlyAborts
from worker_runtime.lifecycle import WorkerLifecycle
from worker_runtime.runtime import WorkerConfig, within_deadline

log = logging.getLogger(__name__)

ALLOCATE_RETRY_S = 0.01
ALLOCATE_MAX_WAIT_S = 5.0
CHANNEL_ORPHAN_S = 10.0
"""A token channel without a subscriber this long is closed and its requests aborted."""
KV_PULL_SPAN = "pdserve.decode_worker.kv_pull"
DECODE_SPAN = "pdserve.decode_worker.decode"
"""This worker's spans of a traced request (router/request_spans.py draws the tree)."""


class DecodeWorker(WorkerLifecycle[DecodeEndpoint]):
    """Ray actor class (wrap with `ray.remote(...)`); also serves the colocated role."""

    def __init__(
        self,
        config: WorkerConfig,
        transfer: KVTransferConfig,
        actor_name: str = "",
        followers: Sequence[Any] = (),
        takes_over: WorkerLifecycle[Any] | None = None,
    ) -> None:
        super().__init__(config, transfer, actor_name, followers, takes_over)
        self._outcomes: dict[str, asyncio.Future[TransferOutcome]] = {}
        self._peer_locks = PeerLocks()  # handshakes under way, one per prefill peer
        self._aborted: set[str] = set()  # streams that `abort` ended (they close with ABORT)
        self._early_aborts = EarlyAborts()  # aborts that found no `submit`/`generate` (yet)
        self._channels: ChannelRegistry | None = None  # set by `start` (needs the loop)
        self._tasks: set[asyncio.Task[Any]] = set()  # request pipelines and reaper aborts
        self._loop: asyncio.AbstractEventLoop | None = None

    async def open_role(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._channels = ChannelRegistry(
            self._loop, lambda rid: self._spawn(self.abort(rid)), CHANNEL_ORPHAN_S
        )
        await super().open_role()

    def _make_endpoint(self, engine: LLMEngine) -> DecodeEndpoint:
        return DecodeEndpoint(
            engine.kv_cache,
            engine.model_id,
            self.runtime.config.worker_id,
            on_done=self._on_outcome,
            on_failed=self._on_outcome,
            config=self.transfer_config,
            budget=self.budget,
            backend_factory=tp.backend_factory() if (tp := self.runtime.tp) is not None else None,
            layer_bounds=engine.layer_bounds,
            model_scales=engine.model_kv_scales,
        )

    def _closing(self) -> None:
        if self._channels is not None:
            self._channels.close_all()  # subscribers take what is left, then their streams end

    @property
    def _registry(self) -> ChannelRegistry:
        if self._channels is None:
            raise RuntimeError("decode worker not started")
        return self._channels

    # ---- transfers --------------------------------------------------------------------------

    def _on_outcome(self, outcome: TransferOutcome) -> None:  # KV-transfer thread
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver_outcome, outcome)

    def _deliver_outcome(self, outcome: TransferOutcome) -> None:
        fut = self._outcomes.pop(outcome.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(outcome)
            return
        # Nobody waits any more (the stream was cancelled): the blocks are ours to free.
        rid = outcome.request_id
        self.runtime.post(lambda e: e.free_transfer_blocks(rid))

    async def _ensure_peer(self, handle: KVHandle) -> None:
        endpoint = self._endpoint
        if endpoint.has_peer(handle.agent_name):
            return
        async with self._peer_locks.hold(handle.agent_name):
            if endpoint.has_peer(handle.agent_name):
                return
            import ray

            try:
                peer = ray.get_actor(
                    actor_name_for(handle.worker_id), namespace=self.runtime.config.namespace
                )
                info = await peer.handshake_info.remote()
            except (ValueError, ray.exceptions.RayActorError) as e:
                # The prefill worker died after it handed the prompt off (nothing is held
                # here yet): a transfer error, which the router retries on other workers.
                raise PeerLost(
                    f"prefill worker {handle.worker_id} is gone ({type(e).__name__}): its KV "
                    "cannot be pulled"
                ) from None
            await asyncio.to_thread(endpoint.add_peer, info)

    async def _allocate(self, req: DecodeRequest, handle: KVHandle) -> TransferAllocation:
        """Reserve destination blocks, waiting briefly while the pool is short."""
        give_up = time.monotonic() + ALLOCATE_MAX_WAIT_S
        if req.deadline is not None:
            give_up = min(give_up, time.monotonic() + max(req.deadline - time.time(), 0.0))
        rid = req.request_id
        while True:
            self._raise_if_aborted(rid)
            try:
                return await self.runtime.call(
                    lambda e: e.allocate_for_transfer(
                        rid,
                        req.kv_token_ids,
                        handle.block_hashes,
                        cache_salt=req.cache_salt,
                        lora_name=req.lora,
                    )
                )
            except NoFreeBlocksError as e:
                if time.monotonic() >= give_up:
                    raise WorkerOverloaded(f"request {rid}: decode KV pool is full ({e})") from e
                await asyncio.sleep(ALLOCATE_RETRY_S)
            except asyncio.CancelledError:
                # The allocation may have run on the engine thread all the same; this runs
                # after it there (commands run in order) and frees what it reserved.
                self.runtime.post(lambda e: e.free_transfer_blocks(rid))
                raise

    async def _pull(
        self, req: DecodeRequest, handle: KVHandle, span: Span = NO_SPAN
    ) -> tuple[int, float]:
        """Pull the prompt's KV into reserved blocks; (tokens transferred, seconds). `span`
        gets what the read moved."""
        await self._ensure_peer(handle)
        alloc = await self._allocate(req, handle)
        if req.request_id in self._aborted:  # aborted while the allocation ran
            self.runtime.post(lambda e: e.free_transfer_blocks(req.request_id))
            self._raise_if_aborted(req.request_id)
        assert self._loop is not None
        fut: asyncio.Future[TransferOutcome] = self._loop.create_future()
        self._outcomes[req.request_id] = fut
        deadline = time.time() + self.transfer_config.transfer_timeout_s
        if req.deadline is not None:
            deadline = min(deadline, req.deadline)
        try:
            self._endpoint.submit(
                handle, alloc.blocks_to_transfer, alloc.num_cached_blocks, deadline
            )
        except BaseException:
            self._outcomes.pop(req.request_id, None)
            self.runtime.post(lambda e: e.free_transfer_blocks(req.request_id))
            raise
        t0 = time.perf_counter()
        try:
            outcome = await asyncio.shield(fut)
        except asyncio.CancelledError:
            if fut.done():
                # The outcome arrived just before the cancellation: nobody else frees.
                self.runtime.post(lambda e: e.free_transfer_blocks(req.request_id))
            else:
                # The outcome will still come; `_deliver_outcome` frees the blocks then.
                self._outcomes.pop(req.request_id, None)
                self._endpoint.cancel(req.request_id)
            raise
        if outcome.state is not TransferState.DONE:
            self.runtime.post(lambda e: e.free_transfer_blocks(req.request_id))
            assert outcome.error is not None
            raise outcome.error
        if span.recording:
            quietly(_traced_pull, span, outcome, handle)
        # Reused blocks are full blocks at the head; everything after them was pulled.
        reused_tokens = outcome.plan.num_reused * self.runtime.config.engine.block_size
        return max(handle.num_tokens - reused_tokens, 0), time.perf_counter() - t0

    def _raise_if_aborted(self, request_id: str) -> None:
        if request_id in self._aborted:
            raise RequestAborted(f"request {request_id} was aborted")

    # ---- requests ---------------------------------------------------------------------------

    async def submit(self, req: DecodeRequest, channel_id: str) -> None:
        """Accept a request whose tokens go to channel `channel_id` (see `subscribe`).

        Returns once the request is held here: a draining or full worker, a request id
        already in flight, or a bad request raise now. Everything after (peer handshake,
        allocation, KV pull, joining the batch, decoding) runs on its own; the request's
        tokens, and its end (a chunk with a finish reason, or a `ChunkError`), arrive on the
        channel. The channel opens here if its subscription has not arrived yet.
        """
        self._start(req, self._registry.get(channel_id))

    async def subscribe(
        self, channel_id: str, lease_s: float | None = None
    ) -> AsyncIterator[list[ChannelItem]]:
        """Stream the channel's batches (call with `num_returns="streaming"`): one list per
        engine step (per wake-up when steps outrun the reader) of `(request_id, TokenChunk)`
        and `ChunkError`. A second subscription to the same id replaces this one (this one
        ends). A channel left without a subscriber for `CHANNEL_ORPHAN_S` is closed and its
        requests aborted.

        With `lease_s`, the subscriber must call `renew(channel_id)` at least that often, or
        the channel is closed (this stream ends) and its requests aborted: Ray keeps an
        actor's streaming call running when its caller dies, so without a lease the requests
        of a dead router would decode on until they finish."""
        registry = self._registry
        channel = registry.get(channel_id)
        epoch = registry.attach(channel, lease_s)
        try:
            while (batch := await channel.next_batch(epoch)) is not None:
                yield batch
        finally:
            registry.detach(channel, epoch)

    async def generate(self, req: DecodeRequest) -> AsyncIterator[TokenChunk]:
        """Stream one request's tokens (call with `num_returns="streaming"`): `submit` on a
        channel of its own. Cancelling the call cancels the request."""
        channel = OutputChannel(f"generate/{req.request_id}")  # private: never reaped
        epoch = channel.attach()
        task = self._start(req, channel)
        finished = False
        try:
            while not finished:
                batch = await channel.next_batch(epoch)
                assert batch is not None, "a private channel is never replaced nor closed"
                for item in batch:
                    if isinstance(item, ChunkError):
                        finished = True
                        raise item.error
                    chunk = item[1]
                    finished = chunk.finish_reason is not None
                    yield chunk
        finally:
            if not finished:
                task.cancel()

    def renew(self, channel_id: str) -> bool:
        """Extend the lease of a subscription (see `subscribe`); False if no such channel."""
        return self._registry.renew(channel_id)

    def channels(self) -> list[ChannelInfo]:
        """The token channels this worker holds (diagnostics and tests)."""
        return self._registry.infos()

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> asyncio.Task[Any]:
        assert self._loop is not None
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _start(self, req: DecodeRequest, channel: OutputChannel) -> asyncio.Task[Any]:
        """Admit the request (raises at once if it cannot be held) and start its pipeline."""
        self.admit()
        rt = self.runtime
        if req.handle is not None and req.first_token_id is None:
            raise ValueError("first_token_id: required with a KV handle")
        if req.handle is None and req.first_token_id is not None:
            # A local prefill samples its own first token: the client would get two.
            raise ValueError("first_token_id: only with a KV handle (a local prefill samples it)")
        sink = RequestSink(channel, req.request_id)
        rt.open_sink(req.request_id, sink)  # raises if the id is in flight here
        channel.adopt(sink)
        if self._early_aborts.take(req.request_id):
            self._aborted.add(req.request_id)  # `_serve` ends it at once, with ABORT
        return self._spawn(self._serve(req, sink))

    async def _serve(self, req: DecodeRequest, sink: RequestSink) -> None:
        """The request's pipeline: pull (or prefill here), join the batch, wait for its end
        (tokens go to the channel on their own); every exit frees what it holds."""
        rt = self.runtime
        rid = req.request_id
        finished = False
        in_engine = False
        span = NO_SPAN  # the decode span, once the request is in the engine
        # Deferred (vocabulary/tracing.py): made in the SDK after the stream's end, so no
        # span work competes with the first token or the stream (prefill worker: the same).
        spans = DeferredSpans()
        try:
            self._raise_if_aborted(rid)  # its abort came before it (see `abort`)
            await rt.compile_constraint(req.sampling)  # a bad one fails before any pull
            if req.handle is None:
                span = self._decode_span(req, spans)
                in_engine = True
                await rt.call(
                    lambda e: e.add_request(
                        rid,
                        req.prompt_token_ids,
                        req.sampling,
                        cache_salt=req.cache_salt,
                        lora_name=req.lora,
                        arrival_time=req.arrival_time or None,
                        prior=req.prior,
                    )
                )
            else:
                with open_span(KV_PULL_SPAN, req.trace, SpanKind.SERVER, deferred=spans) as pulled:
                    got = await self._pull(req, req.handle, pulled)
                sink.num_transferred_tokens, sink.transfer_s = got
                in_engine = True  # from here the engine holds the blocks (abort frees them)
                span = self._decode_span(req, spans)
                self._raise_if_aborted(rid)
                await rt.call(
                    lambda e: e.add_transferred_request(
                        rid,
                        req.first_token_id,  # type: ignore[arg-type]
                        req.sampling,
                        first_token_logprob=req.first_logprob,
                        arrival_time=req.arrival_time or None,
                        prior=req.prior,
                    )
                )
            await _finished(sink, req.deadline)
            finished = True
            span.end()
        except (RequestAborted, TransferCancelled) as e:
            span.end(e)
            if rid in self._aborted:
                sink.end(TokenChunk(token_ids=(), text="", finish_reason=FinishReason.ABORT))
            else:
                sink.end(ChunkError(rid, _portable(e)))
        except asyncio.CancelledError as e:
            span.end(e)
            # The `generate` caller went away (or the worker stops): nobody reads this.
            sink.end(ChunkError(rid, RequestAborted(f"request {rid} cancelled on the worker")))
            raise
        except Exception as e:
            span.end(e)
            sink.end(ChunkError(rid, _portable(e)))
        finally:
            rt.close_stream(rid)
            self._aborted.discard(rid)
            rt.requests_done += 1
            if in_engine and not finished:
                rt.post(lambda e: e.abort_request(rid))
            spans.flush_later(FLUSH_AFTER_S)

    def _decode_span(self, req: DecodeRequest, spans: DeferredSpans) -> Span:
        """The span of a traced request in this worker's engine (a local prefill's included),
        until its last token (deferred into `spans`)."""
        span = open_span(DECODE_SPAN, req.trace, SpanKind.SERVER, deferred=spans)
        if span.recording:
            span.set("pdserve.request_id", req.request_id)
            span.set("pdserve.worker_id", self.runtime.config.worker_id)
            span.set("pdserve.local_prefill", req.handle is None)
        return span

    async def abort(self, request_id: str) -> bool:
        """End a request here and free what it holds: cancel its transfer (the outcome frees
        the blocks) or abort it in the engine. Its stream, if open, ends with a last chunk
        whose finish reason is ABORT. False if nothing was held under that id; a `submit` or
        `generate` of that id that comes after this is then ended at once (with ABORT)."""
        streaming = self.runtime.has_stream(request_id)
        if streaming:
            # Seen by the pipeline at each stage (peer, allocation, submit, engine), so a
            # request between two stages never goes on to reserve or pull anything.
            self._aborted.add(request_id)
        else:
            # No call holds it: it ended, or it has not come yet. The router aborts a request
            # whose `submit` it gave up waiting for; if that call runs after this abort, it
            # would decode to `max_tokens` for nobody, holding its KV blocks.
            self._early_aborts.remember(request_id)
        if request_id in self._outcomes:
            self._endpoint.cancel(request_id)
            return True
        found = await self.runtime.call(lambda e: e.abort_request(request_id))
        if streaming:
            self.runtime.fail_stream(request_id, RequestAborted(f"request {request_id} aborted"))
        return bool(found) or streaming

    # ---- status and drain -------------------------------------------------------------------

    def load(self) -> WorkerLoad:
        rt = self.runtime
        return WorkerLoad(
            worker_id=rt.config.worker_id,
            role=rt.config.role,
            state=rt.state,
            engine=rt.driver.load,
            inflight_requests=rt.num_inflight,
            requests_done=rt.requests_done,
            index_publish_errors=rt.index_publish_errors,
            transfer_stats=self._endpoint.stats() if self.endpoint is not None else None,
            index=rt.index_stats(),
            loras=rt.lora_names,
            process=rt.process_counts(),
            transfer=self._endpoint.load() if self.endpoint is not None else TransferLoad(),
            timestamp=time.time(),
        )

    def transfer_stats(self) -> TransferStats:
        return self._endpoint.stats()


def _traced_pull(span: Span, outcome: TransferOutcome, handle: KVHandle) -> None:
    plan = outcome.plan
    span.set("pdserve.request_id", outcome.request_id)
    span.set("pdserve.prefill_worker", handle.worker_id)
    span.set("pdserve.kv_bytes", plan.nbytes)
    span.set("pdserve.kv_blocks", plan.num_blocks)
    span.set("pdserve.kv_reused_blocks", plan.num_reused)
    span.set("pdserve.kv_descriptors", plan.num_descriptors)
    span.set("pdserve.transfer_queue_ms", outcome.queue_wait_s * 1000)
    span.set("pdserve.transfer_ms", outcome.transfer_s * 1000)


async def _finished(sink: RequestSink, deadline: float | None) -> None:
    """Wait until the request's finishing output reached its channel; raise the error the
    runtime delivered instead, or RequestDeadlineExceeded."""
    error = await within_deadline(sink.done, deadline, sink.request_id)
    if error is not None:
        raise error


def _portable(error: BaseException) -> BaseException:
    """The error itself if it survives the trip to the caller, else a RuntimeError that says
    what it was (one error that cannot be rebuilt must not fail the channel's whole batch).
    Errors are rare: the round trip costs nothing on the token path."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
