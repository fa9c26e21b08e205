"""The prefill worker: a Ray actor that computes prompts and lends their KV to decode workers.

Lifecycle of a request in this worker (the router's Prefill step, router/orchestrator.py):

1. `prefill(req)` arrives: the request joins the engine's waiting queue (prefill-only mode;
   prompts are batched and chunked under the step's token budget; cached prefix blocks of
   earlier prompts are reused).
2. The engine computes the prompt and samples the first token; the request finishes with
   its blocks kept (FINISHED_PREFILLED).
3. The blocks are pinned under a lease (`PrefillEndpoint.hand_off`) and the first token plus
   a `KVHandle` go back to the caller. A request that ended on its first token (eos,
   max_tokens=1) holds nothing and returns no handle.
4. A decode worker pulls the blocks over NIXL (those the engine holds as host-tier copies,
   EngineConfig.host_kv_handoff, straight from the host tier's registered memory) and
   notifies; the lease ends and the blocks go back to the pool (or the host tier's LRU) as
   evictable prefix-cache entries. If no notice comes, the lease
   expires (reaper on a timer) with the same effect.

Aborts: before step 3 the engine aborts the request (blocks freed at once); after it,
`abort(request_id)` ends the lease. A cancelled or timed-out `prefill` call aborts too. An
abort that comes before its `prefill` call (Ray does not order an async actor's calls) is
remembered (worker_runtime/early_aborts.py), and the call, if it still comes, ends at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from engine.core.engine import LLMEngine
from kv_transfer.config import KVTransferConfig
from kv_transfer.prefill_endpoint import PrefillEndpoint
from kv_transfer.protocol import HandshakeInfo
from vocabulary.engine_io import RequestOutput
from vocabulary.kv_events import KVTier
from vocabulary.prefill_api import PrefillRequest, PrefillResult
from vocabulary.tracing import FLUSH_AFTER_S, DeferredSpans, Span, SpanKind, open_span, quietly
from vocabulary.worker_api import RequestAborted, WorkerLoad
from worker_runtime.early_aborts import EarlyAborts
from worker_runtime.lifecycle import WorkerLifecycle
from worker_runtime.runtime import WorkerConfig, next_output

log = logging.getLogger(__name__)

_EWMA = 0.2
PREFILL_SPAN = "pdserve.prefill_worker.prefill"
"""This worker's span of a traced `prefill` call (router/request_spans.py draws the tree)."""


class PrefillWorker(WorkerLifecycle[PrefillEndpoint]):
    """Ray actor class (wrap with `ray.remote(...)`; deploy/control/worker_actors.py creates it)."""

    def __init__(
        self,
        config: WorkerConfig,
        transfer: KVTransferConfig,
        actor_name: str = "",
        followers: Sequence[Any] = (),
        takes_over: WorkerLifecycle[Any] | None = None,
    ) -> None:
        super().__init__(config, transfer, actor_name, followers, takes_over)
        self._tokens_per_s = 0.0
        self._aborted: set[str] = set()  # calls that `abort` ended (they raise RequestAborted)
        self._early_aborts = EarlyAborts()  # aborts that found no `prefill` call (yet)

    def _make_endpoint(self, engine: LLMEngine) -> PrefillEndpoint:
        return PrefillEndpoint(
            engine.kv_cache,
            engine.model_id,
            self.runtime.config.worker_id,
            release_blocks=self._release_blocks,
            config=self.transfer_config,
            followers=self.runtime.tp.agents if self.runtime.tp is not None else (),
            # (a pipeline worker lends no host block: its other stages' are not registered)
            tiers=(
                {KVTier.HOST: engine.host_tier.tensor}
                if engine.host_tier is not None and not engine.layer_bounds
                else None
            ),
            layer_bounds=engine.layer_bounds,
            model_scales=engine.model_kv_scales,
        )

    def _holds_work(self) -> bool:
        return self.runtime.num_inflight > 0 or self._endpoint.stats().held > 0

    def handshake_info(self) -> HandshakeInfo:
        return self._endpoint.handshake_info()

    def _release_blocks(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        # KV-transfer thread: the lease ended (pulled, aborted or expired).
        self.runtime.post(lambda e: e.release_request_blocks(request_id))

    # ---- requests ---------------------------------------------------------------------------

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        # Deferred (vocabulary/tracing.py): made in the SDK after the reply has left,
        # so the router's first token does not wait for it.
        spans = DeferredSpans()
        try:
            with open_span(PREFILL_SPAN, req.trace, SpanKind.SERVER, deferred=spans) as span:
                result = await self._prefill(req)
                if span.recording:
                    quietly(_traced, span, result)
                return result
        finally:
            spans.flush_later(FLUSH_AFTER_S)

    async def _prefill(self, req: PrefillRequest) -> PrefillResult:
        rid = req.request_id
        if self._early_aborts.take(rid):
            raise RequestAborted(f"request {rid} aborted before its prefill call came")
        self.admit()
        rt = self.runtime
        queue = rt.open_stream(rid)
        try:
            await rt.compile_constraint(req.sampling)
            await rt.call(
                lambda e: e.add_request(
                    rid,
                    req.prompt_token_ids,
                    req.sampling,
                    cache_salt=req.cache_salt,
                    lora_name=req.lora,
                    arrival_time=req.arrival_time or None,
                )
            )
            out = await next_output(queue, req.deadline, rid)
            if rid in self._aborted:  # aborted after the output was queued: no hand-off
                raise RequestAborted(f"request {rid} aborted")
            return self._result(out)
        except BaseException:
            rt.post(lambda e: e.abort_request(rid))
            raise
        finally:
            rt.close_stream(rid)
            self._aborted.discard(rid)
            rt.requests_done += 1

    def _result(self, out: RequestOutput) -> PrefillResult:
        t = out.timings
        scheduled = t.first_scheduled or t.arrival
        first = t.first_token or scheduled
        prefill_s = max(first - scheduled, 0.0)
        computed = out.num_prompt_tokens - out.num_cached_prompt_tokens
        if prefill_s > 0 and computed > 0:
            rate = computed / prefill_s
            self._tokens_per_s = (
                rate
                if not self._tokens_per_s
                else ((1 - _EWMA) * self._tokens_per_s + _EWMA * rate)
            )
        handle = None
        if out.kv_handoff is not None:
            h = out.kv_handoff
            handle = self._endpoint.hand_off(
                h.request_id, h.block_ids, h.block_hashes, h.num_tokens, block_tiers=h.block_tiers
            )
        return PrefillResult(
            request_id=out.request_id,
            first_token_id=out.new_token_ids[0],
            first_text=out.text_delta,
            first_logprob=out.logprobs[0] if out.logprobs else None,
            finish_reason=None if handle is not None else out.finish_reason,
            handle=handle,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_prompt_tokens=out.num_cached_prompt_tokens,
            queue_s=max(scheduled - t.arrival, 0.0),
            prefill_s=prefill_s,
            worker_id=self.runtime.config.worker_id,
            first_top_logprobs=out.top_logprobs[0] if out.top_logprobs else None,
            prompt_logprobs=out.prompt_logprobs,
        )

    async def abort(self, request_id: str) -> bool:
        """Free whatever the request holds here: queued or running work, or a lease.

        Safe while a decode worker may still be reading the blocks, as long as that decode is
        being cancelled too (the router aborts both at once): freed blocks can be reused and
        overwritten under the read, but the decode side frees its destination blocks
        without ever entering them in its prefix cache (a pulled prompt's blocks are cached
        only once the read is DONE, in `add_transferred`), so no garbage is ever served. A
        `prefill` call still waiting for the request raises `RequestAborted`, and so does one
        that comes after this abort.
        """
        rt = self.runtime
        waiting = rt.has_stream(request_id)
        if waiting:
            self._aborted.add(request_id)
        else:
            # No call holds it: it ended, or it has not come yet (Ray does not order an async
            # actor's calls); one that comes after this ends at once instead of leasing its
            # blocks to nobody until the lease expires.
            self._early_aborts.remember(request_id)
        found = await rt.call(lambda e: e.abort_request(request_id))
        self._endpoint.cancel(request_id)
        if waiting:
            rt.fail_stream(request_id, RequestAborted(f"request {request_id} aborted"))
        return bool(found) or waiting

    # ---- status and drain -------------------------------------------------------------------

    def load(self) -> WorkerLoad:
        rt = self.runtime
        leases = self._endpoint.stats() if self.endpoint is not None else None
        return WorkerLoad(
            worker_id=rt.config.worker_id,
            role=rt.config.role,
            state=rt.state,
            engine=rt.driver.load,
            inflight_requests=rt.num_inflight,
            requests_done=rt.requests_done,
            index_publish_errors=rt.index_publish_errors,
            index=rt.index_stats(),
            loras=rt.lora_names,
            process=rt.process_counts(),
            leased_blocks=leases.pinned_blocks if leases else 0,
            leases_held=leases.held if leases else 0,
            leases_expired=leases.expired if leases else 0,
            prefill_tokens_per_s=self._tokens_per_s,
            timestamp=time.time(),
        )


def _traced(span: Span, result: PrefillResult) -> None:
    span.set("pdserve.request_id", result.request_id)
    span.set("pdserve.worker_id", result.worker_id)
    span.set("pdserve.prompt_tokens", result.num_prompt_tokens)
    span.set("pdserve.cached_tokens", result.num_cached_prompt_tokens)
    span.set("pdserve.queue_ms", result.queue_s * 1000)
    span.set("pdserve.prefill_ms", result.prefill_s * 1000)
    if result.handle is not None:
        span.set("pdserve.kv_blocks", result.handle.num_blocks)
