"""Continuous batching: which tokens of which requests are computed in the next step.

Policy (vLLM v1's): running requests first, then waiting ones, under one token budget
(`max_num_batched_tokens`) and `max_num_seqs`.

1. Running requests, oldest first, each get min(pending tokens, budget left): one token for a
   decode, the next chunk for a prompt still being prefilled. When the pool cannot supply a
   request's blocks, the newest running request is preempted (blocks freed, recomputed later)
   until it can; if the request itself is the newest, it is preempted (or, when it needs
   more blocks than the whole pool holds, finished with LENGTH), so a step never fails.
2. If nobody was preempted, waiting requests are admitted in FCFS order (preempted ones sit
   at the head): the longest cached prefix of full blocks is reused (at most all but the last
   token, which must be computed to sample; none for a request computing prompt logprobs,
   `Request.needs_prompt_logprobs`), the rest is prefilled in chunks of the budget left. The
   first request that does not fit stops admission for this step (no reordering; a request
   whose LoRA adapter is still loading is passed over, see below).
   Prefix blocks found only in the host tier are onboarded into fresh device blocks (copies
   queued before the step), at most the host tier's `max_blocks_per_step` per step (a request
   needing more than is left waits for the next step; alone, it may take more) and only when
   the worker's in-flight budget, shared with its KV transfers, has room (else it waits in
   the queue, FCFS; engine/kv/host_tier.py `try_onboard`). A transfer reservation whose host-tier
   blocks the budget cannot onboard now pulls them instead.

So decodes are never starved by long prompts, and a long prompt advances by whatever budget
the decodes leave. The scheduler owns block bookkeeping and never touches tensors; its
output is a `ScheduledBatch` (prefill chunks first, then single-token chunks).

Overlap scheduling: `schedule()` may run while the previous step is still on the device, so
a request's newest sampled token may be a placeholder (`Request.num_output_placeholders`):
its decode is scheduled anyway (`SeqChunk.placeholder`: the runner takes the value from that
step's sampled ids), except when that sample certainly ends the request (max_tokens,
max_model_len, or the first token of a prefill-only request): then nothing is scheduled
for it and it is never chosen for preemption (a prefill-only request's blocks are its
hand-off). A request that turns out to have stopped had one decode computed for nothing;
the engine discards its token and `finish` frees its blocks as usual.

Hand-off states outside the two queues: `handed_off` (prefill-only requests finished with
their blocks kept until `release`, engine/core/handoffs.py: with `lend_host_copies`, the copies
the host tier holds instead of their device blocks) and `transferring` (decode-side blocks
reserved for KV that is being pulled, until `add_transferred` or `free_transfer`).

LoRA (`AdapterSlots`, the adapter cache): a request on an adapter computes only while it
holds the adapter's device slot, so a step never mixes more adapters than there are slots.
- Admission acquires the slot first, once per admission (a request that then does not fit
  gives it back, and FCFS stops there as usual). An adapter that is not resident yet (its
  load is started, never waited for) leaves its request waiting in place, and admission
  goes on with the requests behind it: one adapter's load never holds up the base model or
  resident adapters.
- The slot is released exactly once when the request stops computing: finish (a
  prefill-only request's kept blocks do not need it), abort, preemption (re-acquired at
  re-admission), and `free_transfer`.
- A transfer acquires at `reserve_transfer` (the disk read overlaps the KV pull); a
  transferred request that has no slot yet sits in `running` unscheduled (not blocking
  others) until an acquire succeeds.
- An adapter that can never run (unregistered, its read failed) ends its request with
  FINISHED_ABORTED and an `abort_error`, reported in `SchedulerOutput.finished`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.batch import ScheduledBatch, SeqChunk
from engine.core.handoffs import Handoffs
from engine.core.request import Request, RequestStatus
from engine.kv.block_pool import BlockPool, NoFreeBlocksError
from vocabulary.block_hash import BlockHash
from vocabulary.engine_io import LoraLoadError, LoraNotFound
from vocabulary.numeric import cdiv


class UnknownRequestError(KeyError):
    """No request (or hand-off, or transfer) with this id is held here."""


class AdapterSlots(Protocol):
    """The LoRA device slots requests hold while they compute (engine.lora.lora_cache.LoraCache).

    `acquire(name)` answers the slot, now held by the caller until `release(name)`, or None
    when the adapter is not resident yet (its load is started; ask again next step); it never
    waits. It raises LookupError (the adapter is not registered) or RuntimeError (it cannot
    be loaded) when the request can never run here."""

    def acquire(self, name: str) -> int | None: ...

    def release(self, name: str) -> None: ...


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's decision: the batch to run, and requests it preempted or ended."""

    batch: ScheduledBatch
    preempted: tuple[str, ...] = ()
    finished: tuple[Request, ...] = ()
    """Requests the scheduler ended itself (FINISHED_LENGTH: more KV than the whole pool;
    FINISHED_ABORTED: a LoRA adapter that can never run here, with its `abort_error`)."""


@dataclass(frozen=True)
class ReservedTransfer:
    """Decode-side blocks reserved for a request whose prompt KV is being pulled."""

    prompt_token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    num_cached_blocks: int
    """Leading blocks that were already cached here, in either tier (not transferred)."""
    hash_extra: bytes
    lora_name: str = ""
    """The LoRA adapter the KV was computed with ("": the base model)."""
    lora_slot: int = -1
    """The adapter's device slot, held for the request since the reservation (-1: none yet;
    acquired again once it runs)."""


class Scheduler:
    """Waiting/running queues over a `BlockPool` (see the module docstring for the policy)."""

    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        keep_blocks_on_prefill_finish: bool = False,
        max_model_len: int = 0,
        finish_after_first_token: bool = False,
        adapters: AdapterSlots | None = None,
        lend_host_copies: bool = False,
        reserve: Callable[[], int] | None = None,
    ) -> None:
        """`max_model_len` (0: none) and `finish_after_first_token` (prefill-only) say when a
        sample still in flight certainly ends its request (see the module docstring);
        `adapters`: the LoRA slots (None: LoRA off, every request runs the base model);
        `lend_host_copies`: hand-offs hold host-tier copies where there are (docstring);
        `reserve`: blocks this scheduler must leave free for another one sharing the pool
        (a split engine's prefill lane leaves the decode lane room to grow)."""
        self.block_pool = block_pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.keep_blocks_on_prefill_finish = keep_blocks_on_prefill_finish
        self.max_model_len = max_model_len
        self.finish_after_first_token = finish_after_first_token
        self.adapters = adapters
        self.reserve = reserve
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.handoffs = Handoffs(block_pool, block_size, lend_host_copies)
        self.handed_off = self.handoffs.requests
        self.transferring: dict[str, ReservedTransfer] = {}
        self.requests: dict[str, Request] = {}
        """Unfinished requests (waiting or running) by id."""
        self.num_preemptions = 0
        self.num_cache_query_tokens = 0
        self.num_cache_hit_tokens = 0
        self.num_host_hit_tokens = 0
        """Prompt tokens of first admissions found in the host tier (onboarded)."""
        self._onboard_left = 0

    # ---- queues ---------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def num_pending_prefill_tokens(self) -> int:
        """Tokens to compute before each waiting or prefilling request samples again."""
        waiting = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        return waiting + sum(r.num_pending_tokens for r in self.running if r.num_pending_tokens > 1)

    def has_ready_work(self) -> bool:
        """Whether `schedule()` can find tokens to compute without the values of the samples
        in flight: a waiting request, or a running one with tokens other than a sample that
        certainly ends it. (False: the step in flight is the last one until it is read.)"""
        return bool(self.waiting) or any(self._num_schedulable(r) for r in self.running)

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests or rid in self.handed_off or rid in self.transferring:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    # ---- scheduling -----------------------------------------------------------------------

    def schedule(self, only: Container[str] | None = None) -> SchedulerOutput:
        now = time.time()
        budget = self.max_num_batched_tokens
        self._onboard_left = self._onboard_budget()
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []
        finished: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            pending = self._num_schedulable(request, only)
            num_new = min(pending, budget)
            if num_new == 0 or (num_new < pending and not self.enable_chunked_prefill):
                i += 1
                continue
            if not self._hold_adapter(request, finished):
                if not request.is_finished:  # a transferred request waiting for its slot
                    i += 1
                continue
            if request.num_output_placeholders and self._exceeds_pool(request, num_new):
                # Its token in flight may have stopped it; once read, the next step ends it
                # with LENGTH if not (never preempted for a recompute that cannot fit).
                i += 1
                continue
            if self._grow(request, num_new, preempted, finished):
                scheduled.append((request, num_new))
                budget -= num_new
                i += 1
            # else: the request itself left `running` (preempted or finished); the requests
            # after it, if any, certainly finish with a sample in flight (never victims).

        waiting_for_adapter: list[Request] = []  # passed over this step, in queue order
        try:
            while (
                not preempted
                and self.waiting
                and budget > 0
                and len(self.running) < self.max_num_seqs
            ):
                request = self.waiting[0]
                if not self._hold_adapter(request, finished):
                    if not request.is_finished:  # (else `finish` took it off `waiting`)
                        waiting_for_adapter.append(self.waiting.popleft())
                    continue
                num_new = self._admit(request, budget, now)
                if num_new == 0:
                    self._release_adapter(request)
                    break
                self.waiting.popleft()
                self.running.append(request)
                scheduled.append((request, num_new))
                budget -= num_new
        finally:
            self.waiting.extendleft(reversed(waiting_for_adapter))

        chunks = [self._chunk(request, num_new) for request, num_new in scheduled]
        chunks.sort(key=lambda c: c.num_tokens == 1)  # stable: prefill chunks first
        return SchedulerOutput(ScheduledBatch(tuple(chunks)), tuple(preempted), tuple(finished))

    def _num_schedulable(self, request: Request, only: Container[str] | None = None) -> int:
        """Tokens a running request can compute now: its pending ones (a placeholder
        included); none when `only` (a pipeline's groups, engine/core/decode_groups.py) leaves
        it out, or its placeholder's sample certainly ends it (that KV would never be read)."""
        if only is not None and request.request_id not in only:
            return 0
        return 0 if self._finishes_in_flight(request) else request.num_pending_tokens

    def _finishes_in_flight(self, request: Request) -> bool:
        """A sample still in flight certainly ends the request: the first token of a
        prefill-only request, or the one that reaches max_tokens or max_model_len."""
        if not request.num_output_placeholders:
            return False
        num_outputs = request.num_output_tokens + request.num_output_placeholders
        if self.finish_after_first_token or num_outputs >= request.sampling_params.max_tokens:
            return True
        return 0 < self.max_model_len <= request.num_prompt_tokens + num_outputs

    def _exceeds_pool(self, request: Request, num_new: int) -> bool:
        needed = self._blocks_needed(request, num_new)
        return len(request.block_ids) + needed > self.block_pool.num_blocks

    def _grow(
        self, request: Request, num_new: int, preempted: list[str], finished: list[Request]
    ) -> bool:
        """Give a running request blocks for `num_new` more tokens, preempting the newest
        running requests (but those a sample in flight certainly ends) as needed. False if
        the request itself had to leave `running`."""
        needed = self._blocks_needed(request, num_new)
        while not self._can_allocate(needed):
            # `request` itself qualifies, so there is always a victim (never an older one).
            victim = next(r for r in reversed(self.running) if not self._finishes_in_flight(r))
            if victim is request and self._exceeds_pool(request, num_new):
                self.finish(request, RequestStatus.FINISHED_LENGTH)
                finished.append(request)
                return False
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        request.block_ids += self.block_pool.allocate(needed)
        return True

    def _admit(self, request: Request, budget: int, now: float) -> int:
        """Allocate a waiting request's blocks (reusing cached ones, onboarding host-tier
        ones); tokens scheduled, or 0."""
        if request.num_output_placeholders:  # preempted under a step in flight: wait for it
            return 0
        bs = self.block_size
        full = 0 if request.needs_prompt_logprobs else (request.num_tokens - 1) // bs
        hits = self.block_pool.match_prefix_tiers(request.block_hashes[:full])
        num_onboard = hits.count(None)
        spent = self._onboard_left < self._onboard_budget()
        if num_onboard > self._onboard_left and spent:
            return 0  # over what this step may still onboard: next step (FCFS holds)
        num_computed = len(hits) * bs
        remaining = request.num_tokens - num_computed
        num_new = min(remaining, budget)
        if num_new < remaining and not self.enable_chunked_prefill:
            return 0
        num_new_blocks = cdiv(num_computed + num_new, bs) - len(hits)
        on_device = [b for b in hits if b is not None]
        if not self._can_allocate(
            num_new_blocks + num_onboard + self.block_pool.num_evictable_among(on_device)
        ):
            return 0
        if num_onboard and not self._start_onboard(request.request_id, num_onboard):
            return 0  # the in-flight budget holds it back: next step (FCFS holds)
        request.block_ids = self._take_hits(request.block_hashes, hits)
        request.block_ids += self.block_pool.allocate(num_new_blocks)
        self._onboard_left = max(0, self._onboard_left - num_onboard)
        request.num_cached_blocks = len(hits)
        request.num_computed_tokens = num_computed
        if request.status is RequestStatus.WAITING:  # first admission (not a recompute)
            request.first_scheduled_time = now
            request.num_cached_prompt_tokens = num_computed
            self.num_cache_query_tokens += request.num_tokens
            self.num_cache_hit_tokens += num_computed
            self.num_host_hit_tokens += num_onboard * bs
        request.status = RequestStatus.RUNNING
        return num_new

    def _take_hits(
        self, block_hashes: Sequence[BlockHash], hits: Sequence[int | None]
    ) -> list[int]:
        """Reference the device hits (first, so onboarding cannot evict them) and onboard the
        host-tier ones; the blocks in chain order."""
        self.block_pool.touch([b for b in hits if b is not None])
        missing = [h for h, b in zip(block_hashes, hits, strict=False) if b is None]
        onboarded = iter(self.block_pool.onboard(missing))
        return [b if b is not None else next(onboarded) for b in hits]

    def _hold_adapter(self, request: Request, finished: list[Request]) -> bool:
        """Whether the request may compute now: it runs the base model, or holds its adapter's
        slot (acquired here). False while the adapter is not resident yet, and when it can
        never run here: then the request is ended (ABORTED, with its `abort_error`) and
        added to `finished`."""
        if not request.lora_name or request.lora_slot >= 0:
            return True
        slot = None
        error: LoraNotFound | LoraLoadError | None = LoraNotFound(
            f"lora adapter {request.lora_name!r}: LoRA is not enabled"
        )
        if self.adapters is not None:
            try:
                slot, error = self.adapters.acquire(request.lora_name), None
            except (LoraNotFound, LoraLoadError) as e:  # unregistered; its read failed
                error = e  # (the cache's errors name the adapter)
            except (LookupError, RuntimeError) as e:  # anything else ends this request only
                error = LoraLoadError(f"lora adapter {request.lora_name!r}: {e}")
        if error is not None:
            request.abort_error = error
            self.finish(request, RequestStatus.FINISHED_ABORTED)
            finished.append(request)
            return False
        if slot is None:
            return False
        request.lora_slot = slot
        return True

    def _release_adapter(self, request: Request) -> None:
        """Give back the adapter slot the request holds, if any (it stops computing)."""
        if request.lora_slot < 0:
            return
        request.lora_slot = -1
        assert self.adapters is not None
        self.adapters.release(request.lora_name)

    def _start_onboard(self, request_id: str, num_blocks: int, wait: bool = True) -> bool:
        """Whether the host tier may onboard `num_blocks` for the request now (its copies are
        made by `_take_hits` right after; the budget is held from here)."""
        tier = self.block_pool.host_tier
        return tier is None or tier.try_onboard(request_id, num_blocks, wait)

    def _onboard_budget(self) -> int:
        tier = self.block_pool.host_tier
        return tier.max_blocks_per_step if tier is not None else 0

    def _chunk(self, request: Request, num_new: int) -> SeqChunk:
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new
        known = tuple(request.all_token_ids[start : start + num_new])
        sample = request.num_computed_tokens == request.num_tokens + request.num_output_placeholders
        if sample:
            request.num_output_placeholders += 1  # until the engine appends what it samples
        return SeqChunk(
            request_id=request.request_id,
            token_ids=known + (0,) * (num_new - len(known)),
            start_pos=start,
            block_ids=tuple(request.block_ids),
            sample=sample,
            placeholder=len(known) < num_new,
            lora_slot=request.lora_slot,
            all_logits=request.wants_prompt_logits(start),
        )

    def _can_allocate(self, num_blocks: int) -> bool:
        extra = self.reserve() if self.reserve is not None else 0
        return self.block_pool.can_allocate(num_blocks + extra)

    def _blocks_needed(self, request: Request, num_new: int) -> int:
        total = cdiv(request.num_computed_tokens + num_new, self.block_size)
        return max(0, total - len(request.block_ids))

    def _preempt(self, request: Request) -> None:
        # A placeholder stays: the token in flight is appended when read (then recomputed).
        self.running.remove(request)
        self._release_adapter(request)
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_cached_blocks = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- after a step ---------------------------------------------------------------------

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        if num_full > request.num_cached_blocks:
            start = request.num_cached_blocks
            self.block_pool.cache_blocks(
                request.block_ids[start:num_full], request.block_hashes[start:num_full]
            )
            request.num_cached_blocks = num_full

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request. Its adapter slot is released and its blocks are freed, except
        FINISHED_PREFILLED ones when the scheduler keeps blocks for hand-off (prefill-only):
        those wait for `release`."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        del self.requests[request.request_id]
        self._release_adapter(request)
        request.status = status
        request.finished_time = time.time()
        if status is RequestStatus.FINISHED_PREFILLED and self.keep_blocks_on_prefill_finish:
            self.handoffs.keep(request)
        else:
            self.block_pool.free(request.block_ids)
            request.block_ids = []

    def abort(self, request_id: str) -> bool:
        """Abort an unfinished request and free its blocks; False if it is unknown here."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def abort_without_slot(self, lora_name: str, reason: LoraNotFound) -> list[Request]:
        """Abort (with `reason`) the unfinished requests on adapter `lora_name` that hold no
        slot of it (waiting, preempted, transferred and not run yet): it was unregistered,
        so they can never get one. Those holding a slot are left to finish."""
        ended = [r for r in self.requests.values() if r.lora_name == lora_name and r.lora_slot < 0]
        for request in ended:
            request.abort_error = reason
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return ended

    # ---- hand-off -------------------------------------------------------------------------

    def release(self, request_id: str) -> None:
        """Free the blocks a prefill-only request kept for hand-off."""
        if not self.handoffs.release(request_id):
            raise UnknownRequestError(request_id)

    def num_handoff_blocks(self) -> int:
        return self.handoffs.num_device_blocks()

    def can_reserve_transfer(self, num_tokens: int, block_hashes: Sequence[BlockHash]) -> bool:
        """Whether `reserve_transfer` would succeed now."""
        hits = self.block_pool.match_prefix_tiers(block_hashes)
        on_device = [b for b in hits if b is not None]
        needed = cdiv(num_tokens, self.block_size) - len(on_device)
        return self.block_pool.can_allocate(needed + self.block_pool.num_evictable_among(on_device))

    def reserve_transfer(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        hash_extra: bytes,
        lora_name: str = "",
    ) -> ReservedTransfer:
        """Reserve blocks for a prompt's incoming KV, reusing blocks cached here for its
        leading full blocks, and acquire its LoRA adapter's slot (the load starts now if it
        is not resident; the request gets the slot later then). Raises NoFreeBlocksError
        when the pool is short, and what `AdapterSlots.acquire` raises (nothing reserved)."""
        if request_id in self.transferring or request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        num_tokens = len(prompt_token_ids)
        if num_tokens == 0:
            raise ValueError("prompt_token_ids: must not be empty")
        if len(block_hashes) != num_tokens // self.block_size:
            raise ValueError(
                f"block_hashes: expected {num_tokens // self.block_size} hashes for "
                f"{num_tokens} tokens at block size {self.block_size}, got {len(block_hashes)}"
            )
        if not self.can_reserve_transfer(num_tokens, block_hashes):
            raise NoFreeBlocksError(
                f"{cdiv(num_tokens, self.block_size)} blocks needed for the transfer of "
                f"{request_id!r}, {self.block_pool.num_free} free"
            )
        lora_slot = -1
        if lora_name:
            if self.adapters is None:
                raise ValueError(f"lora_name: {lora_name!r}, but LoRA is not enabled")
            slot = self.adapters.acquire(lora_name)
            lora_slot = -1 if slot is None else slot
        hits = self.block_pool.match_prefix_tiers(block_hashes)
        if None in hits and not self._start_onboard(request_id, hits.count(None), wait=False):
            hits = hits[: hits.index(None)]  # no budget to onboard them now: pulled instead
        block_ids = self._take_hits(block_hashes, hits)
        block_ids += self.block_pool.allocate(cdiv(num_tokens, self.block_size) - len(hits))
        reserved = ReservedTransfer(
            prompt_token_ids=tuple(prompt_token_ids),
            block_ids=tuple(block_ids),
            block_hashes=tuple(block_hashes),
            num_cached_blocks=len(hits),
            hash_extra=hash_extra,
            lora_name=lora_name,
            lora_slot=lora_slot,
        )
        self.transferring[request_id] = reserved
        return reserved

    def free_transfer(self, request_id: str) -> None:
        """Give back the blocks of a transfer that failed or was abandoned."""
        transfer = self.transferring.pop(request_id, None)
        if transfer is None:
            raise UnknownRequestError(request_id)
        self.block_pool.free(transfer.block_ids)
        if transfer.lora_slot >= 0:
            assert self.adapters is not None
            self.adapters.release(transfer.lora_name)

    def num_transfer_blocks(self) -> int:
        return sum(len(t.block_ids) for t in self.transferring.values())

    def add_transferred(self, request: Request) -> None:
        """Start decoding a request whose prompt KV landed in its reserved blocks.

        Build `request` from `transferring[request_id]` (its prompt, block hashes and LoRA
        adapter) with the first token appended. The prompt's full blocks become prefix-cache
        entries here. The request joins `running` even past `max_num_seqs` (its blocks are
        already spent; admission bounds how many arrive), with the adapter slot the transfer
        holds (none yet: `schedule` acquires it before the request runs).
        """
        transfer = self.transferring.get(request.request_id)
        if transfer is None:
            raise UnknownRequestError(request.request_id)
        num_tokens = len(transfer.prompt_token_ids)
        # (a migrated request's KV also holds its prior outputs: all its tokens but the last)
        if tuple(request.all_token_ids[:num_tokens]) != transfer.prompt_token_ids or (
            request.num_tokens != num_tokens + 1
        ):
            raise ValueError("prompt_token_ids: differ from those the transfer reserved for")
        if request.lora_name != transfer.lora_name:
            raise ValueError(
                f"lora_name: {request.lora_name!r}, the transfer is for {transfer.lora_name!r}"
            )
        del self.transferring[request.request_id]
        request.lora_slot = transfer.lora_slot
        request.block_ids = list(transfer.block_ids)
        request.num_computed_tokens = num_tokens
        request.num_cached_prompt_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        request.first_scheduled_time = time.time()
        self.cache_computed_blocks(request)
        self.running.append(request)
        self.requests[request.request_id] = request
