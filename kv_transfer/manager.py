"""The decode-side transfer manager: one state machine per pulled `KVHandle`.

Lifecycle of a transfer (`TransferState`):

    submit ──(bad compat hash, unknown peer, duplicate, id not sendable in a notice)──► rejected
    QUEUED ──(budget admits, read started)──► TRANSFERRING ──(backend DONE)──► DONE
    QUEUED ──(deadline passed)──► EXPIRED (TransferTimeout)
    QUEUED ──(lease has less than the safety margin left)──► EXPIRED (LeaseExpired)
    QUEUED ──(cancel, peer lost, start_read failed or raised)──► FAILED
    QUEUED ──(its id cannot be encoded into a heartbeat)──► FAILED
    TRANSFERRING ──(deadline, lease margin; read aborted)──► EXPIRED
    TRANSFERRING ──(poll error or FAILED, peer lost, cancel)──► FAILED
    TRANSFERRING ──(poll, release or the manager raised anything else; read aborted)──► FAILED

A rejected submission never enters the tables; it gets its FAILED outcome at once. A transfer
is TRANSFERRING only together with the backend's id of its started read (`xfer`).

Each transfer reaches exactly one terminal state and produces exactly one `TransferOutcome`:
`on_done` for DONE, `on_failed` for FAILED/EXPIRED. `on_failed` hands the destination blocks
back to the worker: it is called only once the backend promised not to write into them (an
in-flight read is aborted first; if the backend cannot abort yet, the outcome waits until it
can; a backend whose `abort` raises is taken to have dropped the read, since the alternative
is holding the blocks forever). Anything that happens to a finished transfer later (a late
completion, a second cancel) is ignored. After DONE the read's own notification tells the
prefill side to release its lease; after FAILED/EXPIRED an `abort` notice does (best effort:
the lease expires anyway).

Failures are isolated per transfer: an exception that no path expects (a backend raising
something other than `BackendError`, a bug here) while starting, polling, releasing, aborting
or finishing one transfer fails that transfer alone with a `TransferError` naming the request
and what raised (the original exception is its `__cause__`, and is logged with its traceback);
`step()` goes on with the others and never raises.

While queued, transfers are kept alive on the prefill side by heartbeats (one notice per peer
every `heartbeat_interval_s`). Not thread-safe: one thread (the endpoint's loop) calls
everything, with `step()` driving time. The clock is injectable for tests.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kv_transfer.backend import TransferBackend, XferId, XferStatus
from kv_transfer.budget import HOST_LANES, TRANSFERS, Candidate, InFlightBudget
from kv_transfer.config import KVTransferConfig
from kv_transfer.metrics import TransferMetrics
from kv_transfer.protocol import encode_abort, encode_done, encode_heartbeats
from kv_transfer.types import TransferPlan
from vocabulary.kv_handle import KVHandle
from vocabulary.transfer_errors import (
    BackendError,
    HandshakeError,
    LeaseExpired,
    PeerLost,
    TransferCancelled,
    TransferError,
    TransferTimeout,
    UnknownPeer,
)
from vocabulary.transfer_load import TransferLoad, TransferStats

log = logging.getLogger(__name__)

_HISTORY = 4096  # finished request ids remembered for state_of()


class TransferState(enum.Enum):
    QUEUED = "queued"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"

    @property
    def is_terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED, TransferState.EXPIRED)


@dataclass(frozen=True)
class TransferOutcome:
    """How one transfer ended. On FAILED/EXPIRED, `plan.local_block_ids` are free to reuse."""

    request_id: str
    state: TransferState
    plan: TransferPlan
    error: TransferError | None
    queue_wait_s: float
    transfer_s: float
    posted_descriptors: int | None = None  # from backend telemetry, when enabled

    @property
    def gbps(self) -> float:
        if self.transfer_s <= 0:
            return 0.0
        return self.plan.nbytes / self.transfer_s / 1e9


OutcomeCallback = Callable[[TransferOutcome], None]
Clock = Callable[[], float]


@dataclass
class _Transfer:
    handle: KVHandle
    plan: TransferPlan
    candidate: Candidate
    deadline: float
    lease_deadline: float  # what this side believes (raised by each heartbeat it sent)
    submitted_at: float
    state: TransferState = TransferState.QUEUED
    started_at: float = 0.0
    xfer: XferId | None = None  # set exactly when the state is TRANSFERRING
    holds_budget: bool = False  # admitted by the budget, not yet given back
    deferred: bool = False
    abort_result: tuple[TransferState, TransferError] | None = None  # abort not confirmed yet


def _notice_id_problem(request_id: str) -> str | None:
    """Why `request_id` cannot travel in a transfer notice, or None when it can."""
    try:
        encode_done(request_id)
    except ValueError as e:  # empty, contains the separator, or not encodable (surrogates)
        return str(e)
    return None


class TransferManager:
    """Queues, budgets, starts, polls and times out the reads of one decode endpoint."""

    def __init__(
        self,
        backend: TransferBackend,
        config: KVTransferConfig,
        compat_hash: str,
        on_done: OutcomeCallback,
        on_failed: OutcomeCallback,
        clock: Clock,
        budget: InFlightBudget | None = None,
    ) -> None:
        """`budget`: the worker's in-flight budget, shared with its engine's host tier
        (kv_transfer/budget.py); None: one of its own."""
        self.backend = backend
        self.config = config
        self.compat_hash = compat_hash
        self._on_done = on_done
        self._on_failed = on_failed
        self._clock = clock
        self.budget = budget if budget is not None else InFlightBudget(config.budget)
        self.metrics = TransferMetrics()
        self.peers: set[str] = set()
        self._queued: dict[str, _Transfer] = {}  # insertion order is FCFS order
        self._transferring: dict[str, _Transfer] = {}
        self._finished: OrderedDict[str, TransferState] = OrderedDict()
        self._next_heartbeat = clock() + config.heartbeat_interval_s
        self.version = 0  # bumped on every change a load/stats snapshot would show

    # ---- commands -------------------------------------------------------------------------

    def add_peer(self, peer: str) -> None:
        """Mark a peer usable (the caller has loaded its metadata into the backend)."""
        self.peers.add(peer)
        self.version += 1

    def submit(self, handle: KVHandle, plan: TransferPlan, deadline: float | None = None) -> None:
        """Queue the pull of `plan`; a handle that cannot be pulled here fails at once."""
        rid = handle.request_id
        if handle.compat_hash != self.compat_hash:
            msg = (
                f"KV compat hash {handle.compat_hash} differs from this worker's {self.compat_hash}"
            )
            self._reject(plan, HandshakeError(f"request {rid}: {msg}"))
            return
        if handle.agent_name not in self.peers:
            self._reject(plan, UnknownPeer(f"request {rid}: no handshake with {handle.agent_name}"))
            return
        problem = _notice_id_problem(rid)
        if problem is not None:
            self._reject(plan, TransferError(f"request {rid!r} cannot be pulled: {problem}"))
            return
        if rid in self._queued or rid in self._transferring:
            self._reject(plan, TransferError(f"request {rid} is already being transferred"))
            return
        now = self._clock()
        t = _Transfer(
            handle=handle,
            plan=plan,
            candidate=Candidate(rid, plan.peer, plan.num_blocks, plan.nbytes),
            deadline=deadline if deadline is not None else now + self.config.transfer_timeout_s,
            lease_deadline=handle.lease_deadline,
            submitted_at=now,
        )
        self._finished.pop(rid, None)
        if plan.num_blocks == 0:  # everything reused: nothing to read, release the lease
            self._notify(plan.peer, rid, encode_done)
            self._finish(t, TransferState.DONE, None)
            return
        self._queued[rid] = t
        self.version += 1

    def cancel(self, request_id: str) -> bool:
        """Fail a queued or in-flight transfer with `TransferCancelled`; False if not active."""
        t = self._queued.get(request_id) or self._transferring.get(request_id)
        if t is None or t.abort_result is not None:
            return False
        self._end(t, TransferState.FAILED, TransferCancelled(f"request {request_id} cancelled"))
        return True

    def peer_lost(self, peer: str, reason: str) -> None:
        """Fail everything pulled from `peer` and forget it (a new handshake may re-add it)."""
        self.peers.discard(peer)
        self.version += 1
        for t in [*self._queued.values(), *self._transferring.values()]:
            if t.plan.peer == peer and t.abort_result is None and not t.state.is_terminal:
                self._end(t, TransferState.FAILED, PeerLost(f"peer {peer} lost: {reason}"))
        try:
            self.backend.remove_peer(peer)
        except Exception as e:  # the peer is forgotten here either way
            log.warning("removing lost peer %s: %s: %s", peer, type(e).__name__, e)

    def close(self) -> None:
        """Cancel everything (the endpoint is shutting down)."""
        for t in [*self._queued.values(), *self._transferring.values()]:
            if t.abort_result is None and not t.state.is_terminal:
                self._end(t, TransferState.FAILED, TransferCancelled("transfer endpoint closed"))

    # ---- time -----------------------------------------------------------------------------

    def step(self) -> float:
        """Advance every transfer; returns how long the caller may sleep before the next step."""
        self._poll_in_flight()
        self._expire()
        self._start_admitted()
        self._heartbeat()
        if self._transferring:
            return self.config.busy_poll_s
        if not self._queued:
            return self.config.idle_tick_s
        now = self._clock()
        wake = self._next_heartbeat
        for t in self._queued.values():
            wake = min(wake, t.deadline, t.lease_deadline - self.config.lease_safety_margin_s)
        return max(0.0, min(wake - now, self.config.idle_tick_s))

    def _poll_in_flight(self) -> None:
        for t in list(self._transferring.values()):
            if t.state.is_terminal:  # ended meanwhile (its peer was lost by an earlier poll)
                continue
            if t.abort_result is not None:
                self._retry_abort(t, first=False)
                continue
            with self._isolated(t, "polling its read"):
                self._poll(t)

    def _poll(self, t: _Transfer) -> None:
        assert t.xfer is not None
        rid = t.plan.request_id
        try:
            status = self.backend.poll(t.xfer)
        except BackendError as e:
            self._read_failed(t, e)
            return
        if status is XferStatus.DONE:
            posted = self._descriptor_count(t.xfer, rid)
            with self._isolated(t, "releasing its finished read"):
                self.backend.release(t.xfer)
                self._finish(t, TransferState.DONE, None, posted)
        elif status is XferStatus.FAILED:
            self._read_failed(t, BackendError(f"read for {rid} failed"))

    def _descriptor_count(self, xfer: XferId, rid: str) -> int | None:
        """Telemetry only: a backend that cannot tell does not fail the transfer."""
        try:
            return self.backend.descriptor_count(xfer)
        except Exception as e:
            self._unexpected(e, "request %s: backend.descriptor_count raised (ignored)", rid)
            return None

    def _read_failed(self, t: _Transfer, e: BackendError) -> None:
        assert t.xfer is not None
        with self._isolated(t, "releasing its failed read"):
            self.backend.release(t.xfer)
            if e.peer_lost:
                self._finish(t, TransferState.FAILED, PeerLost(f"peer {t.plan.peer} lost: {e}"))
                self.peer_lost(t.plan.peer, str(e))
            else:
                self._finish(t, TransferState.FAILED, TransferError(str(e)))

    def _expire(self) -> None:
        now = self._clock()
        margin = self.config.lease_safety_margin_s
        for t in [*self._queued.values(), *self._transferring.values()]:
            if t.abort_result is not None or t.state.is_terminal:
                continue
            rid = t.plan.request_id
            if now >= t.deadline:
                self._end(t, TransferState.EXPIRED, TransferTimeout(f"request {rid}: deadline"))
            elif now >= t.lease_deadline - margin:
                msg = f"request {rid}: prefill lease ends at {t.lease_deadline:.3f} (now {now:.3f})"
                self._end(t, TransferState.EXPIRED, LeaseExpired(msg))

    def _start_admitted(self) -> None:
        queued = [t.candidate for t in self._queued.values()]
        if not queued and self.budget.head_of(TRANSFERS) is None:
            return
        for c in self.budget.take(queued):  # (an empty queue clears this side's head)
            t = self._queued.get(c.request_id)
            if t is None:  # failed meanwhile (its peer was lost by an earlier start)
                self.budget.release(c)
                continue
            t.holds_budget = True  # given back when it ends (`_finish`), started or not
            with self._isolated(t, "starting its read"):
                self._start(t)
        if self._queued:
            newly_deferred = [t for t in self._queued.values() if not t.deferred]
            for t in newly_deferred:
                t.deferred = True
            self.metrics.record_budget_limited_pass(len(newly_deferred))

    def _start(self, t: _Transfer) -> None:
        """Start the read of a queued transfer; it stays QUEUED until the backend took it."""
        rid = t.plan.request_id
        started = self._clock()  # before the post: a backend may move bytes inside it
        try:
            xfer = self.backend.start_read(t.plan, encode_done(rid))
        except BackendError as e:
            self._finish(t, TransferState.FAILED, PeerLost(str(e)) if e.peer_lost else e)
            if e.peer_lost:
                self.peer_lost(t.plan.peer, str(e))
            return
        del self._queued[rid]
        t.state, t.xfer, t.started_at = TransferState.TRANSFERRING, xfer, started
        self._transferring[rid] = t
        self.version += 1
        oversized = self.budget.is_oversized(t.candidate)
        self.metrics.record_started(t.started_at - t.submitted_at, oversized)

    def _heartbeat(self) -> None:
        now = self._clock()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.config.heartbeat_interval_s
        by_peer: dict[str, list[_Transfer]] = {}
        for t in list(self._queued.values()):
            problem = _notice_id_problem(t.plan.request_id)
            if problem is not None:  # submit refuses such ids; never let one stop the others
                self._fault(t, "encoding its heartbeat", ValueError(problem))
                continue
            by_peer.setdefault(t.plan.peer, []).append(t)
        deadline = now + self.config.lease_extension_s
        for peer, transfers in by_peer.items():
            try:
                for msg in encode_heartbeats([t.plan.request_id for t in transfers], deadline):
                    self.backend.send_notif(peer, msg)
                    self.metrics.record_heartbeat()
                    self.version += 1
            except BackendError as e:
                if e.peer_lost:
                    self.peer_lost(peer, str(e))
                else:
                    log.warning("heartbeat to %s failed: %s", peer, e)
                continue
            except Exception as e:  # leases not extended: they expire unless a later beat gets out
                self._unexpected(e, "heartbeat to %s raised", peer)
                continue
            for t in transfers:
                t.lease_deadline = max(t.lease_deadline, deadline)

    # ---- endings --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _isolated(self, t: _Transfer, doing: str) -> Iterator[None]:
        """Confine any exception raised while `doing` something for `t` to `t` (`_fault`)."""
        try:
            yield
        except Exception as e:
            self._fault(t, doing, e)

    def _fault(self, t: _Transfer, doing: str, e: Exception) -> None:
        """Fail `t` for an exception no path expects; its read is aborted first if in flight."""
        rid = t.plan.request_id
        self._unexpected(e, "request %s: %s raised %s", rid, doing, type(e).__name__)
        if t.state.is_terminal or t.abort_result is not None:
            return  # it has its outcome already, or is ending and its abort is retried
        error = TransferError(f"request {rid}: {doing} raised {type(e).__name__}: {e}")
        error.__cause__ = e
        self._end(t, TransferState.FAILED, error)

    def _unexpected(self, e: Exception, msg: str, *args: object) -> None:
        """Log an exception no path expects, with its traceback, and count it."""
        self.metrics.record_unexpected_error()
        log.error(msg, *args, exc_info=e)

    def _end(self, t: _Transfer, state: TransferState, error: TransferError) -> None:
        """End a transfer that has not finished: abort its read first if it is in flight."""
        if t.state is TransferState.TRANSFERRING:
            t.abort_result = (state, error)
            self._retry_abort(t, first=True)
        else:
            self._finish(t, state, error)

    def _retry_abort(self, t: _Transfer, first: bool) -> None:
        assert t.xfer is not None and t.abort_result is not None
        rid = t.plan.request_id
        try:
            aborted = self.backend.abort(t.xfer)
        except Exception as e:
            self._unexpected(e, "request %s: backend.abort raised; its read is given up", rid)
            aborted = True
        if aborted:
            state, error = t.abort_result
            self._finish(t, state, error)
        elif first:
            log.warning("read %s could not be aborted yet; its blocks stay held", rid)

    def _finish(
        self,
        t: _Transfer,
        state: TransferState,
        error: TransferError | None,
        posted_descriptors: int | None = None,
    ) -> None:
        rid = t.plan.request_id
        if t.state.is_terminal:
            log.error("request %s ended twice (%s, then %s): ignored", rid, t.state, state)
            return
        self.version += 1
        self._queued.pop(rid, None)
        self._transferring.pop(rid, None)
        if t.holds_budget:
            t.holds_budget = False
            self.budget.release(t.candidate)
        now = self._clock()
        started = t.started_at if t.started_at else now
        outcome = TransferOutcome(
            request_id=rid,
            state=state,
            plan=t.plan,
            error=error,
            queue_wait_s=started - t.submitted_at,
            transfer_s=now - started if t.started_at else 0.0,
            posted_descriptors=posted_descriptors,
        )
        t.state = state
        self._finished[rid] = state
        while len(self._finished) > _HISTORY:
            self._finished.popitem(last=False)
        if state is TransferState.DONE:
            self.metrics.record_done(
                t.plan.nbytes,
                t.plan.num_blocks,
                t.plan.num_reused,
                t.plan.num_descriptors,
                outcome.transfer_s,
            )
            callback = self._on_done
        else:
            if state is TransferState.FAILED:
                self.metrics.record_failed()
            else:
                self.metrics.record_expired()
            notify = t.plan.peer in self.peers and not isinstance(error, PeerLost)
            if notify and self._notify(t.plan.peer, rid, encode_abort):
                self.metrics.record_abort_notice()
            callback = self._on_failed
        try:
            callback(outcome)
        except Exception as e:
            self._unexpected(e, "transfer outcome callback failed for %s", rid)

    def _reject(self, plan: TransferPlan, error: TransferError) -> None:
        """Fail a submission that never entered the tables (its blocks are untouched)."""
        self.version += 1
        self.metrics.record_failed()
        outcome = TransferOutcome(plan.request_id, TransferState.FAILED, plan, error, 0.0, 0.0)
        try:
            self._on_failed(outcome)
        except Exception as e:
            self._unexpected(e, "transfer outcome callback failed for %s", plan.request_id)

    def _notify(self, peer: str, rid: str, encode: Callable[[str], bytes]) -> bool:
        """Send `encode(rid)` to `peer`, best effort (a failed notice is logged, not raised)."""
        try:
            message = encode(rid)
        except ValueError as e:  # only reachable for an id that bypassed `submit`'s check
            log.warning("no notice for %s to %s: %s", rid, peer, e)
            return False
        try:
            self.backend.send_notif(peer, message)
            return True
        except BackendError as e:
            log.warning("notice for %s to %s failed: %s", rid, peer, e)
        except Exception as e:
            self._unexpected(e, "notice for %s to %s raised", rid, peer)
        return False

    # ---- views ----------------------------------------------------------------------------

    def state_of(self, request_id: str) -> TransferState | None:
        """Current state, or the final one of a recently finished transfer, else None."""
        t = self._queued.get(request_id) or self._transferring.get(request_id)
        return t.state if t is not None else self._finished.get(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self._queued or self._transferring)

    def load(self) -> TransferLoad:
        """This endpoint's pulls (the host tier's moves in the shared budget are not counted
        here; the engine reports them)."""
        queued = [t.candidate for t in self._queued.values()]
        flying = [t.candidate for t in self._transferring.values()]
        cfg = self.config.budget
        lanes = self.budget.peer_loads(queued)
        return TransferLoad(
            in_flight_transfers=len(flying),
            in_flight_blocks=sum(c.num_blocks for c in flying),
            in_flight_bytes=sum(c.nbytes for c in flying),
            queued_transfers=len(queued),
            queued_blocks=sum(c.num_blocks for c in queued),
            queued_bytes=sum(c.nbytes for c in queued),
            max_inflight_blocks=cfg.max_inflight_blocks,
            max_inflight_bytes=cfg.max_inflight_bytes,
            per_peer=tuple(p for p in lanes if p.peer not in HOST_LANES),
        )

    def stats(self) -> TransferStats:
        return self.metrics.stats
