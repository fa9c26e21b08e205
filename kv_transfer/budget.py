"""The in-flight budget of a worker: how many KV blocks it moves at once, and who goes next.

Two users share one budget (one per worker, kv_transfer/config.py `BudgetConfig`):

- the decode endpoint's transfer manager (kv_transfer/manager.py): NIXL pulls, one lane per
  prefill peer (its agent name);
- the engine's host KV tier (engine/kv/host_tier.py, through the `CopyBudget` protocol it
  declares): onboards (host → device, lane `ONBOARD_LANE`) and offloads (device → host, lane
  `OFFLOAD_LANE`).

Limits are blocks and bytes, over all lanes and per lane (a lane's limits are the per-peer
ones). Admission is first come, first served over the block count of each move:

- a move that fits starts;
- a move that does not fit the global budget stops its user's walk (nobody of that user
  overtakes it), and stands as that user's *head*: the other user admits nothing that would
  not leave room for it, so neither user can starve the other (a burst of onboards cannot
  hold hand-offs back, nor a burst of pulls onboards). When both users have a head, the
  older one is served first (the younger leaves room for it, not the other way round). A
  head its user no longer renews lapses after `HEAD_TTL_S` (its request was aborted);
- a move that does not fit its lane's budget blocks only that lane (FCFS per lane), so a slow
  or busy prefill worker does not stall transfers from the others, and one direction of the
  host tier does not take the whole budget;
- an oversized move (larger than a limit on its own) starts only at the head of its user's
  queue and only when nothing else is in flight; until then it stops the walk and stands as
  the head, so it cannot starve.

An eviction's copy to the host tier cannot wait (the block is about to be overwritten):
`force_move` counts it even past the limits. Thread-safe: the transfer thread and the engine
thread call it; every method holds one lock briefly and never waits.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kv_transfer.config import BudgetConfig
from vocabulary.kv_events import TierMove
from vocabulary.transfer_load import PeerLoad


def lane_of(move: TierMove) -> str:
    """The budget lane of one direction of the host tier's copies."""
    return f"host-tier/{move.value}"


ONBOARD_LANE = lane_of(TierMove.ONBOARD)
OFFLOAD_LANE = lane_of(TierMove.OFFLOAD)
HOST_LANES = frozenset({ONBOARD_LANE, OFFLOAD_LANE})
TRANSFERS = "transfers"
"""The user name of the transfer manager's pulls."""
HOST_TIER = "host-tier"
"""The user name of the engine's host tier moves."""
HEAD_TTL_S = 0.5
"""A head not renewed for this long lapses (the engine renews its own at every step)."""


@dataclass(frozen=True)
class Candidate:
    """What the budget knows about one move: its lane (a prefill peer for a pull, a host-tier
    direction for a copy) and how much it moves."""

    request_id: str
    peer: str
    num_blocks: int
    nbytes: int


@dataclass
class _Head:
    """A user's move held back by the global budget: since when, last renewed when."""

    move: Candidate
    since: float
    renewed: float


@dataclass
class _Usage:
    transfers: int = 0
    blocks: int = 0
    nbytes: int = 0

    def add(self, c: Candidate, sign: int = 1) -> None:
        self.transfers += sign
        self.blocks += sign * c.num_blocks
        self.nbytes += sign * c.nbytes

    def copy(self) -> _Usage:
        return _Usage(self.transfers, self.blocks, self.nbytes)


class InFlightBudget:
    """Counts what is in flight (globally and per lane) and picks what may start next."""

    def __init__(self, config: BudgetConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._total = _Usage()
        self._per_peer: defaultdict[str, _Usage] = defaultdict(_Usage)
        self._heads: dict[str, _Head] = {}

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
        """(moves, blocks, bytes) in flight on lane `peer`."""
        with self._lock:
            u = self._per_peer.get(peer, _Usage())
            return u.transfers, u.blocks, u.nbytes

    def is_oversized(self, c: Candidate) -> bool:
        """True when `c` alone exceeds a global or per-lane limit."""
        cfg = self.config
        return c.num_blocks > min(
            cfg.max_inflight_blocks, cfg.max_inflight_blocks_per_peer
        ) or c.nbytes > min(cfg.max_inflight_bytes, cfg.max_inflight_bytes_per_peer)

    # ---- the transfer manager's side ----------------------------------------------------

    def select(self, queue: Sequence[Candidate], user: str = TRANSFERS) -> list[Candidate]:
        """The queued moves of `user` that may start now, in queue order (module docstring).

        Pure: nothing is acquired and no head is recorded; `take` does both.
        """
        with self._lock:
            return self._select(queue, user)[0]

    def take(
        self, queue: Sequence[Candidate], user: str = TRANSFERS, wait: bool = True
    ) -> list[Candidate]:
        """`select` and `acquire` in one step (no other user's move gets in between); records
        the move that stopped the walk as `user`'s head (cleared when none did; `wait`
        False: a move that does not wait for budget is never a head). Release each one with
        `release` once it ended, or at once if it could not be started."""
        with self._lock:
            admitted, head = self._select(queue, user)
            for c in admitted:
                self._acquire(c)
            if wait or head is None:
                self._set_head(user, head)
            return admitted

    def _select(
        self, queue: Sequence[Candidate], user: str
    ) -> tuple[list[Candidate], Candidate | None]:
        cfg = self.config
        total = self._total.copy()
        per_peer = {p: u.copy() for p, u in self._per_peer.items()}
        older = self._older_heads(user)
        for other in older:  # room kept for the other user's older head
            total.add(other)
        blocked_peers: set[str] = set()
        admitted: list[Candidate] = []
        for index, c in enumerate(queue):
            if c.peer in blocked_peers:
                continue
            if self.is_oversized(c):
                if index == 0 and self._total.transfers == 0 and not older:
                    admitted.append(c)
                    return admitted, None
                return admitted, c  # runs alone, or waits at the head of the line
            if (
                total.blocks + c.num_blocks > cfg.max_inflight_blocks
                or total.nbytes + c.nbytes > cfg.max_inflight_bytes
            ):
                return admitted, c
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
        return admitted, None

    def acquire(self, c: Candidate) -> None:
        with self._lock:
            self._acquire(c)

    def release(self, c: Candidate) -> None:
        with self._lock:
            self._total.add(c, -1)
            peer = self._per_peer[c.peer]
            peer.add(c, -1)
            if peer.transfers == 0:
                del self._per_peer[c.peer]

    def _acquire(self, c: Candidate) -> None:
        self._total.add(c)
        self._per_peer[c.peer].add(c)

    # ---- the host tier's side (engine/kv/host_tier.py `CopyBudget`) ------------------------

    def try_move(
        self, move: TierMove, key: str, num_blocks: int, nbytes: int, wait: bool = True
    ) -> bool:
        """Start a host-tier move of `num_blocks` now if the budget allows (then `end_move` it
        once complete). Refused with `wait`, it stands as the host tier's head (`key` names
        it: a request id, so asking again for the same move keeps its place) until it
        starts or lapses; the engine asks again at its next step."""
        c = Candidate(key, lane_of(move), num_blocks, nbytes)
        return bool(self.take([c], HOST_TIER, wait))

    def force_move(self, move: TierMove, num_blocks: int, nbytes: int) -> None:
        """Count a move that cannot wait (an eviction's copy), even past the limits."""
        self.acquire(Candidate("", lane_of(move), num_blocks, nbytes))

    def end_move(self, move: TierMove, num_blocks: int, nbytes: int) -> None:
        """A move started by `try_move` or `force_move` is complete."""
        self.release(Candidate("", lane_of(move), num_blocks, nbytes))

    # ---- heads ----------------------------------------------------------------------------

    def _set_head(self, user: str, move: Candidate | None) -> None:
        now = self._clock()
        known = self._heads.get(user)
        if move is None:
            self._heads.pop(user, None)
        elif known is not None and known.move.request_id == move.request_id:
            self._heads[user] = _Head(move, known.since, now)  # the same move keeps its place
        else:
            self._heads[user] = _Head(move, now, now)

    def _older_heads(self, user: str) -> list[Candidate]:
        """The heads of other users that came before `user`'s own (all of them when `user`
        has none); lapsed heads are dropped."""
        now = self._clock()
        for other, head in list(self._heads.items()):
            if now - head.renewed > HEAD_TTL_S:
                del self._heads[other]
        mine = self._heads.get(user)
        return [
            h.move
            for other, h in self._heads.items()
            if other != user and (mine is None or (h.since, other) < (mine.since, user))
        ]

    def head_of(self, user: str) -> Candidate | None:
        """`user`'s move that the budget holds back now (None: nothing waits)."""
        with self._lock:
            head = self._heads.get(user)
            return head.move if head is not None else None

    # ---- views ----------------------------------------------------------------------------

    def peer_loads(self, queued: Sequence[Candidate]) -> tuple[PeerLoad, ...]:
        """Per-lane load: what is in flight plus what is queued, sorted by lane."""
        queued_by_peer: defaultdict[str, _Usage] = defaultdict(_Usage)
        for c in queued:
            queued_by_peer[c.peer].add(c)
        with self._lock:
            in_flight = {p: u.copy() for p, u in self._per_peer.items()}
        peers = sorted(set(in_flight) | set(queued_by_peer))
        out = []
        for p in peers:
            f = in_flight.get(p, _Usage())
            q = queued_by_peer.get(p, _Usage())
            out.append(PeerLoad(p, f.transfers, f.blocks, f.nbytes, q.transfers, q.blocks))
        return tuple(out)
