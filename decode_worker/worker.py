"""The decode worker: a Ray actor that pulls a prompt's KV and streams the generated tokens.

Lifecycle of a request in this worker (DESIGN.md steps 6-8):

1. `generate(req)` arrives with a `KVHandle` (disaggregated) or without one (local prefill:
   conditional disaggregation or colocated serving).
2. Pulled requests: the worker makes sure it has a handshake with the prefill peer,
   allocates destination blocks (reusing blocks it already caches for the same prefix; those
   are not transferred), and submits the pull to its `DecodeEndpoint` (in-flight budget,
   deadline). Completion notifies the prefill worker, which ends its lease.
3. Once the KV has landed the request joins the running batch (in-flight batching) with the
   first token the prefill worker sampled; local-prefill requests join the waiting queue.
4. Tokens stream back as `TokenChunk`s (a Ray streaming generator; outputs that pile up
   between two reads are merged into one chunk) until a stop condition, the deadline, or
   cancellation.
5. Finished blocks stay in the pool as evictable prefix-cache entries (KV events go to
   Redis).

Failure paths free everything: a transfer that fails or expires frees its destination blocks
(the endpoint's outcome says when they are safe to reuse — never before a read that might
still write into them has ended); a cancelled or timed-out stream aborts the request in the
engine, or cancels its transfer and lets the outcome free the blocks. `abort(request_id)`
takes the same paths (at whatever stage the request is) and ends the stream with a last
chunk whose finish reason is ABORT.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from decode_worker.api import DecodeRequest, TokenChunk
from engine.block_pool import NoFreeBlocksError
from engine.outputs import RequestOutput, TransferAllocation
from engine.request import FinishReason
from kv_transfer.config import KVTransferConfig
from kv_transfer.decode_endpoint import DecodeEndpoint
from kv_transfer.errors import TransferCancelled
from kv_transfer.manager import TransferOutcome, TransferState
from kv_transfer.metrics import TransferStats
from kv_transfer.types import KVHandle, TransferLoad
from prefill_worker.api import (
    RequestAborted,
    WorkerDraining,
    WorkerInfo,
    WorkerLoad,
    WorkerOverloaded,
    WorkerState,
    actor_name_for,
)
from prefill_worker.runtime import WorkerConfig, WorkerRuntime, next_output

log = logging.getLogger(__name__)

ALLOCATE_RETRY_S = 0.01
ALLOCATE_MAX_WAIT_S = 5.0


class DecodeWorker:
    """Ray actor class (wrap with `ray.remote(...)`); also serves the colocated role."""

    def __init__(
        self, config: WorkerConfig, transfer: KVTransferConfig, actor_name: str = ""
    ) -> None:
        self.runtime = WorkerRuntime(config, actor_name or config.worker_id)
        self.transfer_config = transfer
        self.endpoint: DecodeEndpoint | None = None
        self._outcomes: dict[str, asyncio.Future[TransferOutcome]] = {}
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._aborted: set[str] = set()  # streams that `abort` ended (they close with ABORT)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> WorkerInfo:
        info = await self.runtime.start()
        self._loop = asyncio.get_running_loop()
        engine = self.runtime.engine
        assert engine is not None
        endpoint = DecodeEndpoint(
            engine.kv_cache,
            engine.model_id,
            self.runtime.config.worker_id,
            on_done=self._on_outcome,
            on_failed=self._on_outcome,
            config=self.transfer_config,
        )
        await asyncio.to_thread(endpoint.start)
        self.endpoint = endpoint
        return info

    @property
    def _endpoint(self) -> DecodeEndpoint:
        if self.endpoint is None:
            raise RuntimeError("decode worker not started")
        return self.endpoint

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
        lock = self._peer_locks.setdefault(handle.agent_name, asyncio.Lock())
        async with lock:
            if endpoint.has_peer(handle.agent_name):
                return
            import ray

            peer = ray.get_actor(actor_name_for(handle.worker_id))
            info = await peer.handshake_info.remote()
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
                        rid, req.prompt_token_ids, handle.block_hashes, cache_salt=req.cache_salt
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

    async def _pull(self, req: DecodeRequest, handle: KVHandle) -> tuple[int, float]:
        """Pull the prompt's KV into reserved blocks; (tokens transferred, seconds)."""
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
        # Reused blocks are full blocks at the head; everything after them was pulled.
        reused_tokens = outcome.plan.num_reused * self.runtime.config.engine.block_size
        return max(handle.num_tokens - reused_tokens, 0), time.perf_counter() - t0

    def _raise_if_aborted(self, request_id: str) -> None:
        if request_id in self._aborted:
            raise RequestAborted(f"request {request_id} was aborted")

    # ---- requests ---------------------------------------------------------------------------

    async def generate(self, req: DecodeRequest) -> AsyncIterator[TokenChunk]:
        """Stream the request's tokens (call with `num_returns="streaming"`)."""
        rt = self.runtime
        if rt.state is not WorkerState.READY:
            raise WorkerDraining(f"worker {rt.config.worker_id} is {rt.state.value}")
        if rt.num_inflight >= rt.config.max_inflight_requests:
            raise WorkerOverloaded(f"worker {rt.config.worker_id} holds too many requests")
        rid = req.request_id
        queue = rt.open_stream(rid)
        finished = False
        in_engine = False
        try:
            transferred, transfer_s = 0, 0.0
            if req.handle is None:
                in_engine = True
                await rt.call(
                    lambda e: e.add_request(
                        rid,
                        req.prompt_token_ids,
                        req.sampling,
                        cache_salt=req.cache_salt,
                        arrival_time=req.arrival_time or None,
                    )
                )
            else:
                if req.first_token_id is None:
                    raise ValueError("first_token_id: required with a KV handle")
                transferred, transfer_s = await self._pull(req, req.handle)
                in_engine = True  # from here the engine holds the blocks (abort frees them)
                self._raise_if_aborted(rid)
                await rt.call(
                    lambda e: e.add_transferred_request(
                        rid,
                        req.first_token_id,  # type: ignore[arg-type]
                        req.sampling,
                        first_token_logprob=req.first_logprob,
                        arrival_time=req.arrival_time or None,
                    )
                )
            first = True
            while not finished:
                outs = [await next_output(queue, req.deadline, rid)]
                while not queue.empty():
                    item = queue.get_nowait()
                    if isinstance(item, BaseException):
                        raise item
                    outs.append(item)
                chunk = _merge(outs, first, transferred, transfer_s)
                first = False
                finished = chunk.finish_reason is not None
                yield chunk
        except (RequestAborted, TransferCancelled):
            if rid not in self._aborted:
                raise
            yield TokenChunk(token_ids=(), text="", finish_reason=FinishReason.ABORT)
        finally:
            rt.close_stream(rid)
            self._aborted.discard(rid)
            rt.requests_done += 1
            if in_engine and not finished:
                rt.post(lambda e: e.abort_request(rid))

    async def abort(self, request_id: str) -> bool:
        """End a request here and free what it holds: cancel its transfer (the outcome frees
        the blocks) or abort it in the engine. Its stream, if open, ends with a last chunk
        whose finish reason is ABORT. False if nothing was held under that id."""
        streaming = self.runtime.has_stream(request_id)
        if streaming:
            # Seen by `generate` at each stage (peer, allocation, submit, engine), so a stream
            # between two stages never goes on to reserve or pull anything.
            self._aborted.add(request_id)
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
            transfer=self._endpoint.load() if self.endpoint is not None else TransferLoad(),
            timestamp=time.time(),
        )

    def transfer_stats(self) -> TransferStats:
        return self._endpoint.stats()

    def info(self) -> WorkerInfo:
        assert self.runtime.info is not None
        return self.runtime.info

    def ping(self) -> str:
        return self.runtime.state.value

    async def drain(self, timeout_s: float = 60.0) -> bool:
        """Stop admitting; wait until every in-flight request has finished streaming."""
        rt = self.runtime
        if rt.state is WorkerState.READY:
            rt.state = WorkerState.DRAINING
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if rt.num_inflight == 0:
                return True
            await asyncio.sleep(0.05)
        return False

    def undrain(self) -> None:
        if self.runtime.state is WorkerState.DRAINING:
            self.runtime.state = WorkerState.READY

    async def shutdown(self) -> None:
        if self.endpoint is not None:
            await asyncio.to_thread(self._endpoint.close)
        self.runtime.stop()


def _merge(
    outs: list[RequestOutput], first: bool, transferred: int, transfer_s: float
) -> TokenChunk:
    last = outs[-1]
    logprobs: tuple[float, ...] | None = None
    if any(o.logprobs is not None for o in outs):
        logprobs = tuple(lp for o in outs for lp in (o.logprobs or ()))
    t = last.timings
    scheduled = t.first_scheduled or t.arrival
    return TokenChunk(
        token_ids=tuple(tok for o in outs for tok in o.new_token_ids),
        text="".join(o.text_delta for o in outs),
        logprobs=logprobs,
        finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_prompt_tokens=last.num_cached_prompt_tokens,
        num_transferred_tokens=transferred if first else 0,
        transfer_s=transfer_s if first else 0.0,
        queue_s=max(scheduled - t.arrival, 0.0) if first else 0.0,
        prefill_s=max((t.first_token or scheduled) - scheduled, 0.0) if first else 0.0,
    )
