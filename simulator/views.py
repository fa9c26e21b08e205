"""What the simulated router sees of its workers: the admission loads
(`admission.snapshot.PrefillWorkerLoad`, `DecodeWorkerLoad`) and the placement candidates
(`router.placement.PrefillCandidate`, `DecodeCandidate`) of every worker, as the live router
builds them from load reports.

The cores take a value per worker per request; building them all anew for every request is
what a large cluster's simulation would spend its time on. Here each worker's values are kept
and rebuilt only when an event touched that worker (`touch`, called by simulator/cluster.py
wherever a worker's queues, blocks or transfers change); a candidate carries the request's
prefix hit on that worker, so the workers holding part of the prompt get a copy with theirs
(`with_hits`). The values are the ones a fresh build would give: the same cores decide on them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace

from admission.snapshot import DecodeWorkerLoad, PrefillWorkerLoad
from router.placement import DecodeCandidate, PrefillCandidate
from simulator.workers import Role, SimWorker


@dataclass(frozen=True)
class WorkerViews:
    """Every worker's load and candidate (no prefix hit), and the workers in the cores' own
    order of preference among those without a hit (cluster order within ties). Read it at
    once: `LoadViews` updates the sequences other than `decode_loads` in place."""

    prefill_loads: Sequence[PrefillWorkerLoad]
    decode_loads: tuple[DecodeWorkerLoad, ...]
    prefill_candidates: Sequence[PrefillCandidate]
    decode_candidates: Sequence[DecodeCandidate]
    prefill_order: Sequence[tuple[int, str, int]]
    """(queued prefill tokens, worker id, position), ascending: placement's cost and
    admission's estimated TTFT both rise with the queue when nothing is cached. Read it at
    once: `LoadViews` re-sorts it in place."""
    decode_order: Sequence[tuple[int, str, int]]
    """(active + in-flight transfer blocks, worker id, position), ascending: placement's
    decode cost and tie-break when nothing is cached (read at once, as `prefill_order`)."""
    prefill_at: dict[str, int]
    """worker id → its position in the prefill tuples."""
    decode_at: dict[str, int]

    def admission_prefill(self) -> tuple[PrefillWorkerLoad, ...]:
        """What admission reads of the prefill pool: only the least estimated TTFT, so the
        least-queued worker alone gives the decision every worker would."""
        return (self.prefill_loads[self.prefill_order[0][2]],) if self.prefill_order else ()

    def candidates(
        self, cached_by: dict[str, int], need: int
    ) -> tuple[list[PrefillCandidate], list[DecodeCandidate]]:
        """The candidates `place` chooses among for a prompt whose leading blocks the workers
        in `cached_by` hold, needing `need` decode blocks: every worker with a hit (its hit
        in), and of the rest only the one `place` would prefer among them (for decode, the
        first with `need` free blocks, or the first when none has). `place`'s choice over
        these is its choice over every worker: its orders are total (the worker id breaks
        ties), and a worker without a hit loses to the preferred one on every term."""
        prefill = [replace(self.prefill_candidates[i], cached_blocks=blocks)
                   for worker_id, blocks in cached_by.items()
                   if (i := self.prefill_at.get(worker_id)) is not None]  # fmt: skip
        for _, worker_id, i in self.prefill_order:
            if worker_id not in cached_by:
                prefill.append(self.prefill_candidates[i])
                break
        decode = [replace(self.decode_candidates[i], cached_blocks=blocks)
                  for worker_id, blocks in cached_by.items()
                  if (i := self.decode_at.get(worker_id)) is not None]  # fmt: skip
        first: DecodeCandidate | None = None
        for _, worker_id, i in self.decode_order:
            if worker_id in cached_by:
                continue
            d = self.decode_candidates[i]
            if d.free_kv_blocks >= need:
                first = d
                break
            first = first or d
        if first is not None:
            decode.append(first)
        return prefill, decode


class LoadViews:
    """The workers' `WorkerViews`, kept current by rebuilding the values of the touched
    workers whose load changed (most decode steps change none of it: a block fills every
    `block_size` tokens)."""

    def __init__(
        self, prefill: Sequence[SimWorker], decode: Sequence[SimWorker], throughput: float
    ) -> None:
        self._prefill = list(prefill)
        self._decode = list(decode)
        self._throughput = throughput
        self._prefill_at = {w.worker_id: i for i, w in enumerate(self._prefill)}
        self._decode_at = {w.worker_id: i for i, w in enumerate(self._decode)}
        self._prefill_loads = [self._prefill_load(w) for w in self._prefill]
        self._decode_loads = [self._decode_load(w) for w in self._decode]
        self._prefill_candidates = [self._prefill_candidate(w) for w in self._prefill]
        self._decode_candidates = [self._decode_candidate(w) for w in self._decode]
        self._state = {w.worker_id: _state(w) for w in [*self._prefill, *self._decode]}
        # (sort key, position), ascending: placement's order among workers without a hit
        self._prefill_keys = [(w.routed_prefill_tokens, w.worker_id, i)
                              for i, w in enumerate(self._prefill)]  # fmt: skip
        self._decode_keys = [(w.active_blocks + w.inflight_transfer_blocks, w.worker_id, i)
                             for i, w in enumerate(self._decode)]  # fmt: skip
        self._prefill_sorted = sorted(self._prefill_keys)
        self._decode_sorted = sorted(self._decode_keys)
        self._touched: set[SimWorker] = set()
        self._views: WorkerViews | None = None

    def touch(self, worker: SimWorker) -> None:
        """`worker`'s queues, blocks or transfers may have changed: look before the next
        decision."""
        self._touched.add(worker)

    def current(self) -> WorkerViews:
        changed = False
        for w in self._touched:
            state = _state(w)
            if state == self._state.get(w.worker_id, state):  # the same, or not placed on
                continue
            self._state[w.worker_id] = state
            changed = True
            i = self._prefill_at.get(w.worker_id)
            if i is not None:
                self._prefill_loads[i] = self._prefill_load(w)
                self._prefill_candidates[i] = self._prefill_candidate(w)
                _move(self._prefill_sorted, self._prefill_keys, i, w.routed_prefill_tokens)
            i = self._decode_at.get(w.worker_id)
            if i is not None:
                self._decode_loads[i] = self._decode_load(w)
                self._decode_candidates[i] = self._decode_candidate(w)
                load = w.active_blocks + w.inflight_transfer_blocks
                _move(self._decode_sorted, self._decode_keys, i, load)
        self._touched.clear()
        if changed or self._views is None:
            self._views = WorkerViews(
                self._prefill_loads,
                tuple(self._decode_loads),
                self._prefill_candidates,
                self._decode_candidates,
                self._prefill_sorted,
                self._decode_sorted,
                self._prefill_at,
                self._decode_at,
            )
        return self._views

    def _prefill_load(self, w: SimWorker) -> PrefillWorkerLoad:
        return PrefillWorkerLoad(w.worker_id, w.routed_prefill_tokens, self._throughput)

    @staticmethod
    def _decode_load(w: SimWorker) -> DecodeWorkerLoad:
        return DecodeWorkerLoad(
            w.worker_id,
            total_blocks=w.total_blocks,
            free_blocks=min(w.free_blocks, w.total_blocks),
            inflight_transfer_blocks=w.inflight_transfer_blocks,
        )

    @staticmethod
    def _prefill_candidate(w: SimWorker) -> PrefillCandidate:
        return PrefillCandidate(w.worker_id, 0, w.routed_prefill_tokens)

    @staticmethod
    def _decode_candidate(w: SimWorker) -> DecodeCandidate:
        return DecodeCandidate(
            w.worker_id,
            0,
            w.active_blocks,
            w.inflight_transfer_blocks,
            w.free_blocks,
            prefills_locally=w.role in (Role.COLOCATED, Role.SPLIT),
            running_requests=len(w.running) + w.expected,
            queued_prefill_tokens=w.routed_prefill_tokens,
        )


def _state(w: SimWorker) -> tuple[int, int, int, int, int]:
    """Everything the loads and candidates read of `w`."""
    return (w.routed_prefill_tokens, w.used_blocks, w.reserved_decode_blocks,
            w.inflight_transfer_blocks, len(w.running) + w.expected)  # fmt: skip


def _move(ordered: list[tuple[int, str, int]], keys: list[tuple[int, str, int]], i: int,
          value: int) -> None:  # fmt: skip
    """Re-sort position `i` in `ordered` under its new `value`."""
    old = keys[i]
    del ordered[bisect.bisect_left(ordered, old)]
    keys[i] = (value, old[1], i)
    bisect.insort(ordered, keys[i])
