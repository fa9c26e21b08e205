"""The in-flight budget of a decode endpoint: how much it pulls at once, and who goes next.

Limits are blocks and bytes, over all peers and per prefill peer (`BudgetConfig`). Admission
is first come, first served over the estimated block count of each queued transfer:

- a request that fits starts;
- a request that does not fit the global budget stops the walk (nobody overtakes it);
- a request that does not fit its peer's budget blocks only that peer (FCFS per peer), so a
  slow or busy prefill worker does not stall transfers from the others;
- an oversized request (larger than a limit on its own) starts only at the head of the queue
  and only when nothing else is in flight; until then it stops the walk, so it cannot starve.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from kv_transfer.config import BudgetConfig
from kv_transfer.types import PeerLoad


@dataclass(frozen=True)
class Candidate:
    """What the budget knows about one transfer: who it pulls from and how much."""

    request_id: str
    peer: str
    num_blocks: int
    nbytes: int


@dataclass
class _Usage:
    transfers: int = 0
    blocks: int = 0
    nbytes: int = 0

    def add(self, c: Candidate, sign: int = 1) -> None:
        self.transfers += sign
        self.blocks += sign * c.num_blocks
        self.nbytes += sign * c.nbytes


class InFlightBudget:
    """Counts what is in flight (globally and per peer) and picks what may start next."""

    def __init__(self, config: BudgetConfig) -> None:
        self.config = config
        self._total = _Usage()
        self._per_peer: defaultdict[str, _Usage] = defaultdict(_Usage)

    @property
    def num_transfers(self) -> int:
        return self._total.transfers

    @property
    def num_blocks(self) -> int:
        return self._total.blocks

    @property
    def nbytes(self) -> int:
        return self._total.nbytes

    def peer_usage(self, peer: str) -> tuple[int, int, int]:
        """(transfers, blocks, bytes) in flight from `peer`."""
        u = self._per_peer.get(peer, _Usage())
        return u.transfers, u.blocks, u.nbytes

    def is_oversized(self, c: Candidate) -> bool:
        """True when `c` alone exceeds a global or per-peer limit."""
        cfg = self.config
        return c.num_blocks > min(
            cfg.max_inflight_blocks, cfg.max_inflight_blocks_per_peer
        ) or c.nbytes > min(cfg.max_inflight_bytes, cfg.max_inflight_bytes_per_peer)

    def select(self, queue: Sequence[Candidate]) -> list[Candidate]:
        """The queued transfers that may start now, in queue order (see module docstring).

        Pure: nothing is acquired; call `acquire` for each one actually started.
        """
        cfg = self.config
        total = _Usage(self._total.transfers, self._total.blocks, self._total.nbytes)
        per_peer = {p: _Usage(u.transfers, u.blocks, u.nbytes) for p, u in self._per_peer.items()}
        blocked_peers: set[str] = set()
        admitted: list[Candidate] = []
        for index, c in enumerate(queue):
            if c.peer in blocked_peers:
                continue
            if self.is_oversized(c):
                if index == 0 and total.transfers == 0:
                    admitted.append(c)
                break  # runs alone, or waits at the head of the line
            if (
                total.blocks + c.num_blocks > cfg.max_inflight_blocks
                or total.nbytes + c.nbytes > cfg.max_inflight_bytes
            ):
                break
            peer = per_peer.setdefault(c.peer, _Usage())
            if (
                peer.blocks + c.num_blocks > cfg.max_inflight_blocks_per_peer
                or peer.nbytes + c.nbytes > cfg.max_inflight_bytes_per_peer
            ):
                blocked_peers.add(c.peer)
                continue
            total.add(c)
            peer.add(c)
            admitted.append(c)
        return admitted

    def acquire(self, c: Candidate) -> None:
        self._total.add(c)
        self._per_peer[c.peer].add(c)

    def release(self, c: Candidate) -> None:
        self._total.add(c, -1)
        peer = self._per_peer[c.peer]
        peer.add(c, -1)
        if peer.transfers == 0:
            del self._per_peer[c.peer]

    def peer_loads(self, queued: Sequence[Candidate]) -> tuple[PeerLoad, ...]:
        """Per-peer load: what is in flight plus what is queued, sorted by peer."""
        queued_by_peer: defaultdict[str, _Usage] = defaultdict(_Usage)
        for c in queued:
            queued_by_peer[c.peer].add(c)
        peers = sorted(set(self._per_peer) | set(queued_by_peer))
        out = []
        for p in peers:
            f = self._per_peer.get(p, _Usage())
            q = queued_by_peer.get(p, _Usage())
            out.append(PeerLoad(p, f.transfers, f.blocks, f.nbytes, q.transfers, q.blocks))
        return tuple(out)
