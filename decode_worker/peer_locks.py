"""One lock per prefill peer, held while the decode worker makes its handshake with that peer
(decode_worker/worker.py `_ensure_peer`), so that concurrent requests from a new peer make one
handshake. A lock lives only while a request holds or waits for it: a worker that runs for
weeks meets a new prefill peer for every replaced or added prefill worker, and keeps none of
their locks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class PeerLocks:
    """Locks by peer name, each dropped when its last holder or waiter leaves. Not
    thread-safe: the actor's event loop owns it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # peer → (lock, holders + waiters)

    def __len__(self) -> int:
        """Peers whose lock is held or waited for now."""
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, peer: str) -> AsyncIterator[None]:
        """Hold `peer`'s lock for the block (waiting while another request holds it)."""
        lock, users = self._locks.get(peer, (asyncio.Lock(), 0))
        self._locks[peer] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:  # also when cancelled while waiting
            lock, users = self._locks[peer]
            if users == 1:
                del self._locks[peer]
            else:
                self._locks[peer] = (lock, users - 1)
