"""The pool of KV blocks of one worker: reference counts, the prefix cache and its events.

A block is in exactly one of three places:

    in use      ref_count > 0 (held by running sequences, a hand-off, or a pending transfer);
                it may carry a hash (then it is also a prefix-cache entry others can share)
    free        ref_count == 0, no hash: handed out first, oldest-freed first
    evictable   ref_count == 0 with a hash: still a cache entry; reused (evicted, REMOVED
                event) only when no free block is left, least recently freed first

Sharing is by reference: a cache hit takes a reference on the cached block, so a block with
ref_count > 0 is never evicted; that is also how hand-off pins blocks (the holder keeps its
reference until it releases). The pool only does bookkeeping; it never touches the KV tensor.

With a host tier (engine/kv/host_tier.py) a cached block that becomes evictable is offered to
it (copied to host memory at the next flush), and an evicted block whose hash lives on in
the host tier leaves as OFFLOADED rather than REMOVED; `match_prefix_tiers` walks both tiers
and `onboard` brings host-tier blocks back into fresh device blocks. A hand-off may hold
host-tier copies instead of device blocks (`lend_host_copies`: pinned host slots, read by the
decode worker from host memory), so its device blocks return to the pool at once.

Every change of the set of cached hashes leaves as a `KVEvent` with a sequence number that
grows by one per event (`take_events`); `cached_hashes` is the snapshot for a full resync.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vocabulary.block_hash import BlockHash
from vocabulary.kv_events import KVEvent, KVEventKind

if TYPE_CHECKING:  # engine.kv.host_tier imports torch; the router imports this module without it
    from engine.kv.host_tier import HostTier


class NoFreeBlocksError(RuntimeError):
    """More blocks were requested than the pool can hand out (check `can_allocate` first)."""


class BlockPool:
    """Fixed set of block ids [0, num_blocks) with ref counts and a hash → block prefix cache.

    Invariants: `num_free + num_used == num_blocks`; a hash maps to at most one block; a
    block with a hash is in `_evictable` iff its ref count is 0; block ids returned by
    `allocate` are valid until the caller passes them to `free`.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        max_pending_events: int = 65536,
        host_tier: HostTier | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        # Bounded: when nobody drains, the oldest events drop and the consumer sees a gap in
        # the sequence numbers, which it answers with a resync from `cached_hashes`.
        self._events: deque[KVEvent] = deque(maxlen=max_pending_events)
        self._next_seq = 0
        self.num_evicted = 0
        """Cached blocks evicted since construction (counter for metrics)."""
        self.host_tier = host_tier if enable_caching else None

    # ---- capacity -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now (free plus evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks that are prefix-cache entries (in use or evictable)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash a block is cached under, or None."""
        return self._hashes[block_id]

    # ---- allocation -----------------------------------------------------------------------

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out `num_blocks` blocks with ref count 1: free ones first, then evict (LRU),
        in ascending id order.

        Evicted blocks lose their hash and are reported in one REMOVED event per call.
        Ascending order matters for KV transfer: a request's blocks are read as runs of ids
        adjacent on both sides, one NIXL descriptor per run. Freed sequences come back to
        the free/LRU lists as groups (tail first), so sorting turns a later allocation
        from them back into long runs (descriptors per transfer after the pool has cycled:
        docs/benchmarks.md, "KV transfer").
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if not self.can_allocate(num_blocks):
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {self.num_free} free")
        block_ids: list[int] = []
        evicted: list[BlockHash] = []
        offloaded: list[BlockHash] = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block_hash = self._hashes[block_id]
                assert block_hash is not None
                del self._cached[block_hash]
                self._hashes[block_id] = None
                kept = self.host_tier is not None and self.host_tier.on_device_evict(
                    block_id, block_hash
                )
                (offloaded if kept else evicted).append(block_hash)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        self.num_evicted += len(evicted) + len(offloaded)
        if offloaded:
            self._emit(KVEventKind.OFFLOADED, offloaded)
        evicted += self._host_dropped()
        if evicted:
            self._emit(KVEventKind.REMOVED, evicted)
        block_ids.sort()
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block (pass a sequence's blocks in sequence order).

        Blocks reaching 0 are released in reverse order, so a sequence's tail blocks (the
        least likely to be shared) are evicted before its head blocks.
        """
        for block_id in reversed(block_ids):
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed more often than allocated")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                block_hash = self._hashes[block_id]
                if block_hash is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = None
                    if self.host_tier is not None:
                        self.host_tier.offer(block_id, block_hash)

    # ---- prefix cache ---------------------------------------------------------------------

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest cached prefix of a hash chain. Takes no reference:
        the ids are valid only until the next `allocate`; call `touch` to keep them."""
        if not self.enable_caching:
            return []
        block_ids: list[int] = []
        for block_hash in block_hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def match_prefix_tiers(self, block_hashes: Sequence[BlockHash]) -> list[int | None]:
        """The longest prefix of a hash chain held in either tier: per block its device block
        id, or None where only the host tier holds it (`onboard` brings those back). Takes no
        reference, like `match_prefix`."""
        if not self.enable_caching:
            return []
        hits: list[int | None] = []
        for block_hash in block_hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None and (self.host_tier is None or block_hash not in self.host_tier):
                break
            hits.append(block_id)
        return hits

    def onboard(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Fresh device blocks (ref count 1, cached: a STORED event) holding these host-tier
        blocks; the copies are queued on the current stream, before any later step.
        Check `can_allocate(len(block_hashes))` first."""
        tier = self.host_tier
        if not block_hashes:
            return []
        if tier is None:
            raise ValueError("onboard needs a host tier")
        slots = [tier.lookup(h) for h in block_hashes]
        if any(s is None for s in slots):
            raise ValueError("onboard: a block is not in the host tier (match first)")
        held = [s for s in slots if s is not None]
        tier.pin(held)  # the allocation below may offload into the host tier: not over these
        try:
            block_ids = self.allocate(len(block_hashes))
            tier.onboard(list(zip(held, block_ids, strict=True)))
        finally:
            tier.unpin(held)
        self.cache_blocks(block_ids, block_hashes)
        return block_ids

    def flush_host_tier(self, offload: bool = True) -> None:
        """Before a step, on its stream: fence it behind offloads it may overwrite, and (with
        `offload`; a split engine's decode loop's steps only) copy out offered blocks
        (engine/kv/host_tier.py). Hashes the host LRU let go of leave as REMOVED."""
        if self.host_tier is None:
            return
        self.host_tier.fence()
        if not offload:
            return
        self.host_tier.flush()
        dropped = self._host_dropped()
        if dropped:
            self._emit(KVEventKind.REMOVED, dropped)

    def _host_dropped(self) -> list[BlockHash]:
        """Hashes the host tier let go of that the device pool does not cache either."""
        if self.host_tier is None:
            return []
        return [h for h in self.host_tier.take_dropped() if h not in self._cached]

    def lend_host_copies(
        self, block_ids: list[int], block_hashes: Sequence[BlockHash]
    ) -> dict[int, int]:
        """Swap a holder's references on the first `len(block_hashes)` blocks of `block_ids`
        for pins on their host-tier copies, where the tier holds one that is complete: the
        device blocks go back to the pool (evictable, still cached), the host slots stay
        pinned (never reused by the LRU) until `return_host_copies`. Returns {position: host
        slot}; those positions of `block_ids` become -1 (no device reference held)."""
        tier = self.host_tier
        if tier is None:
            return {}
        lent: dict[int, int] = {}
        for i, block_hash in enumerate(block_hashes):
            slot = tier.lookup(block_hash)
            if slot is not None and block_ids[i] >= 0 and tier.is_complete(slot):
                lent[i] = slot
        tier.pin(list(lent.values()))
        tier.num_lent += len(lent)
        self.free([block_ids[i] for i in sorted(lent)])
        for i in lent:
            block_ids[i] = -1
        return lent

    def return_host_copies(self, slots: Sequence[int]) -> None:
        """End the pins `lend_host_copies` took (the slots go back to the host LRU)."""
        if slots:
            assert self.host_tier is not None
            self.host_tier.unpin(slots)

    def host_only_hashes(self) -> tuple[BlockHash, ...]:
        """Hashes held in the host tier and not cached in the device pool (for a resync)."""
        if self.host_tier is None:
            return ()
        return tuple(h for h in self.host_tier.hashes() if h not in self._cached)

    def num_evictable_among(self, block_ids: Sequence[int]) -> int:
        """How many of these blocks `touch` would take out of the evictable set."""
        return sum(1 for b in block_ids if self._ref_counts[b] == 0)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one reference on each (cached) block, e.g. for a cache hit or a hand-off pin."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if block_id not in self._evictable:
                    raise ValueError(f"block {block_id} is free; allocate it instead")
                del self._evictable[block_id]
                if self.host_tier is not None:
                    block_hash = self._hashes[block_id]
                    assert block_hash is not None
                    self.host_tier.withdraw(block_hash)
            self._ref_counts[block_id] += 1

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        """Register full, computed, in-use blocks under their hashes (one STORED event).

        A hash that is already cached (another block computed the same prefix at the same
        time) is skipped: the block stays an ordinary block and is freed as such.
        """
        if len(block_ids) != len(block_hashes):
            raise ValueError("block_ids and block_hashes differ in length")
        if not self.enable_caching:
            return
        stored: list[BlockHash] = []
        for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} is not in use; only held blocks are cached")
            if self._hashes[block_id] is not None or block_hash in self._cached:
                continue
            self._hashes[block_id] = block_hash
            self._cached[block_hash] = block_id
            stored.append(block_hash)
        if stored:
            self._emit(KVEventKind.STORED, stored)

    def reset_prefix_cache(self) -> None:
        """Forget every hash (blocks in use keep their data but are no longer shareable);
        evictable blocks become free. Emits one CLEARED event."""
        for block_id in self._evictable:
            self._free.append(block_id)
        self._evictable.clear()
        self._cached.clear()
        if self.host_tier is not None:
            self.host_tier.clear()
        self._hashes = [None] * self.num_blocks
        self._emit(KVEventKind.CLEARED, [])

    def cached_hashes(self) -> tuple[BlockHash, ...]:
        """Every hash cached now (snapshot for a full index resync, valid as of `last_seq`)."""
        return tuple(self._cached)

    # ---- events ---------------------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest event emitted so far (-1 before the first)."""
        return self._next_seq - 1

    def take_events(self) -> list[KVEvent]:
        """The events since the previous call, oldest first (the list is drained)."""
        events = list(self._events)
        self._events.clear()
        return events

    def _emit(self, kind: KVEventKind, block_hashes: list[BlockHash]) -> None:
        self._events.append(KVEvent(self._next_seq, kind, tuple(block_hashes)))
        self._next_seq += 1
