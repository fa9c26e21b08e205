"""The host-memory KV tier: prefix blocks the device pool lets go of, kept in host RAM.

Without it an evicted block is gone and a returning chat session recomputes its history once
the device pool has cycled. With it (`EngineConfig.host_kv_gb`), the pool (engine/kv/block_pool.py)
offers every cached block that becomes evictable (ref count 0, a hash) to this tier, which
copies it to a host slot; when the device pool later evicts the block, its hash lives on here,
and a prefix hit here is onboarded (copied back into a device block) before the request is
computed, instead of being recomputed.

Why copy on free and not on evict: an evicted block is overwritten by the very next step, so
a copy made at eviction would have to finish before that step starts (a stall on the step's
stream). A block that becomes evictable usually stays cached for many steps more, so its copy
runs on a side stream while the device computes, and by the time it is evicted the copy is
long done. When it is not (evicted within a step or two of being freed), the next step waits
on the device for that copy only (`fence`), never the host.

Layout: one host tensor in the device pool's layout with `num_blocks` blocks (engine/kv/kv_cache.py:
[num_blocks, ...] for a block-first pool, [num_layers, num_blocks, ...] for a layer-major
one), pinned when CUDA is present (the device's copy engine reads and writes it directly, and
NIXL can register it). So a host block has the device block's segments (one, or one per
layer), and a peer reading it over NIXL pairs them up with its own pool's. A move's blocks go
through a staging buffer on the device (engine/kv/block_mover.py): gathered there in one
kernel, then one copy per segment and run of adjacent host slots, not one per segment and
block (a few hundred copies where a layer-major pool's scattered blocks made thousands a
step). The tier is LRU over its slots; a
slot is taken out of the LRU while something reads it (`pin`, e.g. a transfer lease), so it
is never overwritten under a reader.

Bookkeeping vs tensors: `HostTier` owns both, but the block pool only calls its bookkeeping
methods; the copies are queued by the engine (`flush` before each launch, `onboard` while
scheduling), in stream order with the steps. On CPU copies are synchronous and `fence` is a
no-op; the logic is the same. A disk tier would sit behind this one with the same interface
(`HostTier.lookup` / `take` / `offer`), holding what the host LRU drops (not built).

A pipeline worker (engine/core/pp_runner.py): every stage holds its layers' part of each host
block, in slots of the same ids. Rank 0's tier decides (its pool's bookkeeping is the
worker's) and, `mirrored`, logs each copy it queues (`HostCopy`, taken by `take_copies`);
the other stages replay them in order before the next step (engine/kv/host_mirror.py). A
mirrored tier copies only at `flush` (just before a step is launched, so the stages copy
the same device blocks before that step too) and drops an offer that an eviction finds
uncopied (`on_device_evict`) rather than copy it there: that copy would come outside any
step, and a transfer into the reused block might overwrite it on another stage first.

Budget (`CopyBudget`, the worker's kv_transfer/budget.py `InFlightBudget`, shared with its KV
transfers): every copy is a move that holds budget from the moment it is decided until its
copies are known complete on the device (`_reap`, at the next decision; at once on CPU).
The decisions never wait: an onboard the budget refuses (`try_onboard`) leaves its request
in the waiting queue for the next step (engine/core/scheduler.py), a flush it refuses leaves the
offers for the next step; an eviction's copy cannot wait and is counted past the limits
(`force_move`). Without a budget (an engine outside a worker) every move is allowed; the
per-step cap `max_blocks_per_step` holds either way (it bounds what one step waits for).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.kv.block_mover import BlockMover, stream_movers
from vocabulary.block_hash import BlockHash
from vocabulary.engine_io import HostTierStats, TierMoveStats
from vocabulary.kv_events import TierMove

HEAD_RENEW_S = 0.5
"""An onboard refused by the budget counts as queued until its request asks again this late."""


class CopyBudget(Protocol):
    """The in-flight budget a host tier's copies go through (kv_transfer/budget.py
    `InFlightBudget` implements it): `try_move` starts a move if the budget allows (`wait`:
    a refused move keeps its place at the head of the line, asked again by `key`),
    `force_move` counts one that cannot wait, `end_move` gives a move's budget back."""

    def try_move(
        self, move: TierMove, key: str, num_blocks: int, nbytes: int, wait: bool = True
    ) -> bool: ...

    def force_move(self, move: TierMove, num_blocks: int, nbytes: int) -> None: ...

    def end_move(self, move: TierMove, num_blocks: int, nbytes: int) -> None: ...


@dataclass(frozen=True)
class HostCopy:
    """One copy rank 0's tier queued, for the other stages of a pipeline to make too."""

    offload: bool
    """Device blocks into host slots (else host slots into device blocks)."""
    pairs: tuple[tuple[int, int], ...]
    """(device block id, host slot) pairs, either way."""


@dataclass
class _Ticket:
    """A move holding budget: complete once `event` is (None: queued in no stream yet, or
    copied synchronously)."""

    move: TierMove
    num_blocks: int
    event: torch.cuda.Event | None = None


@dataclass
class _MoveCounters:
    wait_s: float = 0.0
    deferred: int = 0
    waiting: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    """Refused onboards by request: (blocks, first refused, last asked)."""


class HostTier:
    """Host slots [0, num_blocks) holding device-pool blocks by hash, LRU (module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        device_kv: torch.Tensor,
        max_blocks_per_step: int,
        block_dim: int = 0,
    ) -> None:
        """`device_kv` is the device pool's tensor, whose block ids index dimension
        `block_dim` (`KVCacheSpec.block_dim`)."""
        if num_blocks <= 0:
            raise ValueError(f"host tier num_blocks must be positive, got {num_blocks}")
        if max_blocks_per_step <= 0:
            raise ValueError(
                f"host tier max_blocks_per_step must be positive, got {max_blocks_per_step}"
            )
        self.num_blocks = num_blocks
        self.max_blocks_per_step = max_blocks_per_step
        self.device_kv = device_kv
        cuda = device_kv.device.type == "cuda"
        self.tensor = host_blocks(device_kv, num_blocks, block_dim)
        """The host blocks, in the device pool's layout (module docstring)."""
        self.block_nbytes = self.tensor.numel() // num_blocks * self.tensor.element_size()
        self._movers = stream_movers(device_kv, self.tensor, block_dim, max_blocks_per_step)
        """(the steps' streams': onboards and evictions' copies; the side stream's: offloads)
        (engine/kv/block_mover.py: a move on another stream than its buffer's last one waits
        for that one)."""
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._pins = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Offers: device blocks (by hash) that became evictable and are not here yet, with
        # when they were offered.
        self._offers: OrderedDict[BlockHash, tuple[int, float]] = OrderedDict()
        self.budget: CopyBudget | None = None
        """The worker's in-flight budget (set by the worker; None: every move is allowed)."""
        self._tickets: list[_Ticket] = []
        self._pending_onboard: _Ticket | None = None  # granted by `try_onboard`, not copied
        self._counters = {move: _MoveCounters() for move in TierMove}
        self._stream = torch.cuda.Stream(device_kv.device) if cuda else None
        # Side-stream offloads not known complete: by device block (a step overwriting the
        # block waits: `fence`) and by host slot (an onboard reading the slot waits).
        self._copy_events: dict[int, torch.cuda.Event] = {}
        self._slot_events: dict[int, torch.cuda.Event] = {}
        self._needs_fence: list[torch.cuda.Event] = []
        self._dropped: list[BlockHash] = []
        self.num_offloaded = self.num_onboarded = self.num_evicted = self.num_fenced = 0
        self.num_lent = 0
        """Blocks handed off from here (engine/core/handoffs.py), not from the device pool."""
        self._log: list[HostCopy] | None = None  # mirrored: copies since `take_copies`

    @property
    def mirrored(self) -> bool:
        return self._log is not None

    def mirror(self) -> None:
        """Log every copy from now on for the other stages of a pipeline (module docstring)."""
        self._log = []

    def take_copies(self) -> tuple[HostCopy, ...]:
        """The copies queued since the previous call, in order (none unless mirrored)."""
        if not self._log:
            return ()
        copies, self._log = tuple(self._log), []
        return copies

    # ---- bookkeeping (the block pool's side) ------------------------------------------------

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    @property
    def num_cached(self) -> int:
        return len(self._slots)

    def hashes(self) -> tuple[BlockHash, ...]:
        return tuple(self._slots)

    def offer(self, block_id: int, block_hash: BlockHash) -> None:
        """A device block with this hash became evictable: copy it here at the next `flush`
        (nothing to do when the hash is here already; then it counts as recently used)."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
        else:
            self._offers[block_hash] = (block_id, time.monotonic())

    def withdraw(self, block_hash: BlockHash) -> None:
        """The device block was taken again (a hit) before its copy was made: not needed."""
        self._offers.pop(block_hash, None)

    def on_device_evict(self, block_id: int, block_hash: BlockHash) -> bool:
        """The device pool is about to reuse `block_id`: True when its data lives on here.

        An offer not copied yet is copied now, in stream order before any later step (the
        block's data is still intact: nothing overwrites it before the next launch).
        A copy still in flight on the side stream makes the next step wait for it (`fence`).
        """
        if block_hash in self._offers:
            del self._offers[block_hash]
            if self.mirrored:  # copied outside a step: not on a pipeline (module docstring)
                return False
            ticket = self._force(TierMove.OFFLOAD, 1)
            return self._copy_out([(block_id, block_hash)], ticket, side_stream=False) > 0
        event = self._copy_events.pop(block_id, None)
        if event is not None and not event.query():
            self._needs_fence.append(event)
        return block_hash in self._slots

    def clear(self) -> None:
        """Forget every hash (a prefix-cache reset); pinned slots keep their data."""
        self._offers.clear()
        for slot in self._slots.values():
            self._hash_of[slot] = None
            if self._pins[slot] == 0:
                self._free.append(slot)
        self._slots.clear()

    # ---- onboard / pins -------------------------------------------------------------------

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The host slot holding this hash, or None."""
        return self._slots.get(block_hash)

    def is_complete(self, slot: int) -> bool:
        """Whether the slot's data is in place (no offload into it still in flight): a reader
        outside the device streams (a NIXL transfer) may read it."""
        event = self._slot_events.get(slot)
        return event is None or bool(event.query())

    def pin(self, slots: Sequence[int]) -> None:
        """Keep slots out of LRU reuse while something outside reads them (a transfer)."""
        for slot in slots:
            self._pins[slot] += 1

    def unpin(self, slots: Sequence[int]) -> None:
        for slot in slots:
            if self._pins[slot] <= 0:
                raise ValueError(f"host slot {slot} unpinned more often than pinned")
            self._pins[slot] -= 1
            if self._pins[slot] == 0 and self._hash_of[slot] is None:
                self._free.append(slot)

    def try_onboard(self, key: str, num_blocks: int, wait: bool = True) -> bool:
        """Whether an onboard of `num_blocks` for request `key` may be made now (then `onboard`
        it at once: the budget is held from here). Refused, the request waits (`wait`: it
        keeps its place at the head of the budget's line and counts as queued)."""
        self._pending_onboard = None  # one granted and never copied is complete: given back
        self._reap()
        counters = self._counters[TierMove.ONBOARD]
        nbytes = num_blocks * self.block_nbytes
        now = time.monotonic()
        if self.budget is not None and not self.budget.try_move(
            TierMove.ONBOARD, key, num_blocks, nbytes, wait
        ):
            if wait:
                first = counters.waiting.get(key, (0, now, now))[1]
                if key not in counters.waiting:
                    counters.deferred += 1
                counters.waiting[key] = (num_blocks, first, now)
            return False
        waited = counters.waiting.pop(key, None)
        if waited is not None:
            counters.wait_s += now - waited[1]
        self._pending_onboard = _Ticket(TierMove.ONBOARD, num_blocks)
        self._tickets.append(self._pending_onboard)
        return True

    def onboard(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy host slots into device blocks: `(slot, device_block_id)` pairs. Queued on the
        current (step) stream, so the step that reads the blocks runs after the copy. The
        budget `try_onboard` granted covers it (none granted: counted as a forced move)."""
        ticket, self._pending_onboard = self._pending_onboard, None
        if ticket is None:
            ticket = self._force(TierMove.ONBOARD, len(pairs))
        if self._slot_events:
            stream = torch.cuda.current_stream(self.device_kv.device)
            for slot, _ in pairs:
                event = self._slot_events.pop(slot, None)
                if event is not None and not event.query():
                    stream.wait_event(event)
        self._movers[0].to_device(pairs)
        if self._log is not None:
            self._log.append(HostCopy(False, tuple((b, slot) for slot, b in pairs)))
        ticket.event = self._record(None)
        for slot, _ in pairs:
            block_hash = self._hash_of[slot]
            if block_hash is not None:
                self._slots.move_to_end(block_hash)
        self.num_onboarded += len(pairs)

    # ---- copies (the engine's side) -------------------------------------------------------

    def flush(self) -> None:
        """Copy up to `max_blocks_per_step` offered blocks out (side stream); called before a
        step is launched. Offers beyond that, or all of them when the budget refuses the
        move, wait for the next step."""
        self._reap()
        if not self._offers:
            return
        n = min(len(self._offers), self.max_blocks_per_step)
        counters = self._counters[TierMove.OFFLOAD]
        if self.budget is not None and not self.budget.try_move(
            TierMove.OFFLOAD, "offload", n, n * self.block_nbytes
        ):
            counters.deferred += 1
            return
        ticket = _Ticket(TierMove.OFFLOAD, n)
        self._tickets.append(ticket)
        now = time.monotonic()
        batch: list[tuple[int, BlockHash]] = []
        while len(batch) < n:
            block_hash, (block_id, offered) = self._offers.popitem(last=False)
            counters.wait_s += now - offered
            batch.append((block_id, block_hash))
        self._copy_out(batch, ticket, side_stream=True)

    def fence(self) -> None:
        """Make the step about to launch wait (on the device) for offloads of blocks it may
        overwrite. The host never waits."""
        if not self._needs_fence:
            return
        stream = torch.cuda.current_stream(self.device_kv.device)
        for event in self._needs_fence:
            stream.wait_event(event)
        self.num_fenced += 1
        self._needs_fence.clear()

    def _copy_out(
        self, batch: Sequence[tuple[int, BlockHash]], ticket: _Ticket, side_stream: bool
    ) -> int:
        """Copy device blocks into fresh host slots (LRU reuse when full); blocks copied.
        `ticket` (the move's budget) completes with the copies."""
        pairs: list[tuple[int, int]] = []
        for block_id, block_hash in batch:
            slot = self._take_slot()
            if slot is None:  # every slot pinned: this block is dropped
                break
            self._hash_of[slot] = block_hash
            self._slots[block_hash] = slot
            pairs.append((block_id, slot))
        if self._log is not None:
            self._log.append(HostCopy(True, tuple(pairs)))
        if self._stream is None or not side_stream:
            self._movers[0].to_host(pairs)
            ticket.event = self._record(None)
        else:
            event = offload_beside(self._stream, self._movers[1], pairs)
            ticket.event = event
            self._forget_completed()
            for block_id, slot in pairs:
                self._copy_events[block_id] = event
                self._slot_events[slot] = event
        self.num_offloaded += len(pairs)
        return len(pairs)

    def _forget_completed(self) -> None:
        if len(self._copy_events) > 4 * self.max_blocks_per_step:
            self._copy_events = {b: e for b, e in self._copy_events.items() if not e.query()}
            self._slot_events = {s: e for s, e in self._slot_events.items() if not e.query()}

    def wait_slots(self, slots: Sequence[int]) -> None:
        """Block the caller until these slots' offloads are complete (a reader outside the
        device streams, e.g. a NIXL transfer of host memory)."""
        for slot in slots:
            event = self._slot_events.get(slot)
            if event is not None:
                event.synchronize()

    # ---- budget ---------------------------------------------------------------------------

    def _force(self, move: TierMove, num_blocks: int) -> _Ticket:
        """A move that cannot wait: counted in the budget past its limits."""
        self._reap()
        if self.budget is not None:
            self.budget.force_move(move, num_blocks, num_blocks * self.block_nbytes)
        ticket = _Ticket(move, num_blocks)
        self._tickets.append(ticket)
        return ticket

    def _record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """An event after the copies just queued on `stream` (None: the current one); None
        on CPU, where they are complete already."""
        if self.device_kv.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(stream or torch.cuda.current_stream(self.device_kv.device))
        return event

    def _reap(self) -> None:
        """Give back the budget of every move whose copies are complete."""
        if not self._tickets:
            return
        left: list[_Ticket] = []
        for t in self._tickets:
            if t is self._pending_onboard or (t.event is not None and not t.event.query()):
                left.append(t)
            elif self.budget is not None:
                self.budget.end_move(t.move, t.num_blocks, t.num_blocks * self.block_nbytes)
        self._tickets = left

    def _move_stats(self, move: TierMove) -> TierMoveStats:
        c = self._counters[move]
        if move is TierMove.ONBOARD:
            now = time.monotonic()
            for key, (_, _, asked) in list(c.waiting.items()):
                if now - asked > HEAD_RENEW_S:  # its request left the queue another way
                    del c.waiting[key]
            queued = sum(n for n, _, _ in c.waiting.values())
        else:
            queued = len(self._offers)
        done = self.num_onboarded if move is TierMove.ONBOARD else self.num_offloaded
        return TierMoveStats(
            queued_blocks=queued,
            inflight_blocks=sum(t.num_blocks for t in self._tickets if t.move is move),
            done_blocks=done,
            done_bytes=done * self.block_nbytes,
            wait_s=c.wait_s,
            deferred=c.deferred,
        )

    def stats(self) -> HostTierStats:
        """The tier's counters. Also gives back the budget of moves complete by now: the
        engine's driver reads its load after every step and while idle, so an idle engine
        holds no budget for copies that are done."""
        self._reap()
        return HostTierStats(
            num_blocks=self.num_blocks,
            num_cached=len(self._slots),
            num_offloaded=self.num_offloaded,
            num_onboarded=self.num_onboarded,
            num_evicted=self.num_evicted,
            num_fenced=self.num_fenced,
            offload_bytes=self.num_offloaded * self.block_nbytes,
            onboard_bytes=self.num_onboarded * self.block_nbytes,
            num_pinned=sum(1 for pins in self._pins if pins),
            num_lent=self.num_lent,
            onboard=self._move_stats(TierMove.ONBOARD),
            offload=self._move_stats(TierMove.OFFLOAD),
        )

    def take_dropped(self) -> list[BlockHash]:
        """Hashes the LRU let go of since the last call (the pool reports them)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.popleft()
        for block_hash, slot in self._slots.items():  # LRU first; pinned slots are skipped
            if self._pins[slot] == 0:
                del self._slots[block_hash]
                self._hash_of[slot] = None
                self.num_evicted += 1
                self._dropped.append(block_hash)
                return slot
        return None


def host_blocks(device_kv: torch.Tensor, num_blocks: int, block_dim: int) -> torch.Tensor:
    """A host tensor of `num_blocks` blocks in the layout of the device pool `device_kv`,
    pinned when it is on a GPU."""
    shape = list(device_kv.shape)
    shape[block_dim] = num_blocks
    pin = device_kv.device.type == "cuda"
    return torch.zeros(shape, dtype=device_kv.dtype, pin_memory=pin)


def offload_beside(
    stream: torch.cuda.Stream, mover: BlockMover, pairs: Sequence[tuple[int, int]]
) -> torch.cuda.Event:
    """Copy device blocks into host slots (`(block, slot)` pairs) with `mover` on the side
    `stream`, after everything queued so far on the current stream (the steps that wrote
    the blocks); the event of their completion."""
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        mover.to_host(pairs)
        event = torch.cuda.Event()
        event.record(stream)
    return event
