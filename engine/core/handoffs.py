"""Prefill-only requests that finished with their KV kept for a hand-off, until released.

A request here holds references on the blocks of its prompt (never evicted meanwhile) until
`release` (the decode worker pulled them, or the lease ended). With a host tier and
`lend_host_copies` (EngineConfig.host_kv_handoff), the blocks whose copy the host tier
holds complete are held there instead: their host slots are pinned (the host LRU never reuses
them) and their device blocks go back to the pool at once (still cached). `kv_handoff` says,
per block, which tier its id is in; the decode worker reads host-tier blocks from the pinned
host memory over NIXL, without a copy back to the device.
"""

from __future__ import annotations

from engine.core.request import Request
from engine.kv.block_pool import BlockPool
from vocabulary.engine_io import KVHandoff
from vocabulary.kv_events import KVTier
from vocabulary.numeric import cdiv


class Handoffs:
    """The hand-offs of one scheduler (see the module docstring)."""

    def __init__(self, block_pool: BlockPool, block_size: int, lend_host_copies: bool) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.lend_host_copies = lend_host_copies and block_pool.host_tier is not None
        self.requests: dict[str, Request] = {}
        self.lent: dict[str, dict[int, int]] = {}
        """Blocks held as host-tier copies: request id → {position: host slot}."""

    def keep(self, request: Request) -> None:
        """Hold a finished request's blocks (lending its host-tier copies, if on)."""
        self.requests[request.request_id] = request
        full = request.block_hashes[: request.num_prompt_tokens // self.block_size]
        if self.lend_host_copies and full:
            lent = self.block_pool.lend_host_copies(request.block_ids, full)
            if lent:
                self.lent[request.request_id] = lent

    def release(self, request_id: str) -> bool:
        """Free what the hand-off holds (device blocks and host pins); False if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.block_pool.free([b for b in request.block_ids if b >= 0])
        self.block_pool.return_host_copies(list(self.lent.pop(request_id, {}).values()))
        request.block_ids = []
        return True

    def kv_handoff(self, request: Request) -> KVHandoff | None:
        """What a request held here hands off (None: it is not held here)."""
        if request.request_id not in self.requests or not request.block_ids:
            return None
        num_tokens = request.num_prompt_tokens
        lent = self.lent.get(request.request_id, {})
        blocks = request.block_ids[: cdiv(num_tokens, self.block_size)]
        tiers = [KVTier.HOST if i in lent else KVTier.DEVICE for i in range(len(blocks))]
        return KVHandoff(
            request_id=request.request_id,
            block_ids=tuple(lent.get(i, b) for i, b in enumerate(blocks)),
            block_hashes=tuple(request.block_hashes[: num_tokens // self.block_size]),
            num_tokens=num_tokens,
            first_token_id=request.output_token_ids[0],
            block_tiers=tuple(tiers) if lent else (),
        )

    def num_device_blocks(self) -> int:
        """Device blocks the hand-offs hold (their lent host-tier copies are not counted)."""
        return sum(sum(1 for b in r.block_ids if b >= 0) for r in self.requests.values())

    def num_host_slots(self) -> int:
        """Host-tier slots the hand-offs hold pinned."""
        return sum(len(lent) for lent in self.lent.values())
