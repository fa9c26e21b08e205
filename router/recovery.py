"""The recovery policy: what a request does after one of its attempts fails.

`decide(failure, progress, limits)` is pure (no I/O, no clock, no cluster access): the
orchestrator describes the failure (the stage it happened in, the error with Ray's wrapper
removed, the worker) and the request's progress (what the client has, what is left to try),
and carries out the decision it gets back. router/errors.py maps the error of a `Fail` to its
status; this module only says whether the request fails.

    stage     error                                 when                       decision
    PLACE     any                                                               Fail(error)
    PREFILL   worker fault (`is_worker_fault`)      tries < max, workers left  Retry(PREFILL_WORKER)
    PREFILL   worker fault                          otherwise                   Fail(WorkerLost)
    PREFILL   anything else (deadline, cancel, ...)                             Fail(error)
    HAND_OFF  worker fault, TransferError,          retries < max, a prefill    Retry(PAIR)
              WorkerLost (StageTimeout included)    worker left or none sent
    HAND_OFF  the same                              retries < max, first token  Resume
                                                    sent, no prefill worker
    HAND_OFF  the same                              retries used up             Fail(error)
    HAND_OFF  anything else (deadline, cancel, ...)                             Fail(error)
    DECODE,   worker fault, TransferError,          migrations < limit, a      Retry(PAIR)
    LOCAL     WorkerLost (a broken token channel,   prefill worker left or
              a stuck worker's StageTimeout)        no token sent
    DECODE,   the same                              migrations < limit,        Resume
    LOCAL                                           tokens sent, no prefill
                                                    worker
    DECODE,   the same                              migrations used up         Fail(error)
    LOCAL
    DECODE,   anything else (deadline, cancel, bad input, ...)                  Fail(error)
    LOCAL

A retry after the client has tokens (a migration, or a hand-off retried after the first
token) continues its stream: the tokens sent follow the prompt in the new attempt's prefill
and count as the new decode request's output (`vocabulary.engine_io.PriorOutput`), so no token is
lost or repeated and greedy or seeded sampling goes on as in one undisturbed run.

`Attempt` is the other half: the worker-facing id and the exclusions a decision leaves for the
next try (`another_prefill_worker`, `fresh`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from router.errors import WorkerLost, is_actor_death, unwrap
from router.placement import Placement
from vocabulary.transfer_errors import TransferError
from vocabulary.worker_api import StepFailed, WorkerDraining, WorkerOverloaded, WorkerStopped


class Stage(enum.Enum):
    """Where an attempt was when it failed."""

    PLACE = "place"
    """Choosing its workers (no decode worker: NoWorkerError)."""
    PREFILL = "prefill"
    """Waiting for a prefill worker's answer (queue + prompt)."""
    HAND_OFF = "hand-off"
    """From a prefill worker's result (its blocks under a lease) to the decode worker's first
    decoded token: the first token written to the client, the decode submit, the KV pull."""
    DECODE = "decode"
    """The decode worker's stream, after it decoded at least one token."""
    LOCAL = "local"
    """The decode worker alone: a local prefill, or a resume (prompt + first token)."""


_WORKER_FAULTS: tuple[type[BaseException], ...] = (
    WorkerDraining,
    WorkerOverloaded,
    WorkerStopped,
    StepFailed,
)


def is_worker_fault(error: BaseException) -> bool:
    """An error of one worker that another worker may not have (draining, full, stopped,
    failing, or its actor dead)."""
    return isinstance(error, _WORKER_FAULTS) or is_actor_death(error)


def _hand_off_retryable(error: BaseException) -> bool:
    """A hand-off failure that a fresh prefill on other workers may fix."""
    return isinstance(error, (TransferError, WorkerLost)) or is_worker_fault(error)


@dataclass(frozen=True)
class Failure:
    stage: Stage
    error: BaseException
    """The error itself (router.errors.unwrap applied)."""
    worker_id: str | None = None
    """The worker of the failed stage (the prefill worker in PREFILL, else the decode one)."""


def failure_of(
    error: BaseException, placement: Placement | None, prefilled: bool, decoded: bool
) -> Failure:
    """A failed attempt as the policy sees it: the stage follows from what it had (workers,
    a prefill lease, tokens decoded after the prefill worker's first)."""
    err = unwrap(error)
    if placement is None:
        return Failure(Stage.PLACE, err)
    if placement.local_prefill:
        return Failure(Stage.LOCAL, err, placement.decode_worker_id)
    if not prefilled:
        return Failure(Stage.PREFILL, err, placement.prefill_worker_id)
    stage = Stage.DECODE if decoded else Stage.HAND_OFF
    return Failure(stage, err, placement.decode_worker_id)


@dataclass(frozen=True)
class ProgressSnapshot:
    """What the request has done and what is left to try, when an attempt failed."""

    first_token_sent: bool
    """The client has the prefill worker's first token."""
    handoff_retries: int
    """Fresh attempts (Retry(PAIR) or Resume) already made."""
    prefill_tries: int
    """Prefill workers tried in this attempt, the failed one included."""
    prefill_workers_left: int
    """Serving prefill workers this request has not failed on."""
    migrations: int = 0
    """Attempts already made after a decode worker failed (DECODE or LOCAL)."""


@dataclass(frozen=True)
class RecoveryLimits:
    max_handoff_retries: int = 1
    """Fresh attempts after failed hand-offs (before the first decoded token)."""
    max_prefill_attempts: int = 3
    """Prefill workers tried in one attempt."""
    migration_limit: int = 3
    """Fresh attempts after the decode worker of a running request failed."""


class RetryScope(enum.Enum):
    PREFILL_WORKER = "prefill worker"
    """The same attempt (same id, same decode worker) with another prefill worker."""
    PAIR = "pair"
    """A fresh attempt under a fresh worker-facing id: placed again (the failed decode worker
    avoided), a fresh prefill whose first token is dropped if the client has one."""


@dataclass(frozen=True)
class Retry:
    scope: RetryScope


@dataclass(frozen=True)
class Resume:
    """A fresh attempt on a decode worker alone: prompt + the tokens already sent become its
    prompt, and it samples the rest (each token reaches the client once)."""


@dataclass(frozen=True)
class Fail:
    error: BaseException
    """What the request ends with (the failure's own error, or a summary of it)."""


Decision = Retry | Resume | Fail


def decide(failure: Failure, progress: ProgressSnapshot, limits: RecoveryLimits) -> Decision:
    """The decision for one failed attempt (table in the module docstring)."""
    error = failure.error
    if failure.stage is Stage.PREFILL:
        if not is_worker_fault(error):
            return Fail(error)
        if (
            progress.prefill_workers_left == 0
            or progress.prefill_tries >= limits.max_prefill_attempts
        ):
            return Fail(WorkerLost(f"prefill worker {failure.worker_id}: {error}"))
        return Retry(RetryScope.PREFILL_WORKER)
    if (
        failure.stage is Stage.HAND_OFF
        and _hand_off_retryable(error)
        and progress.handoff_retries < limits.max_handoff_retries
    ):
        return _continue(progress)
    if (
        failure.stage in (Stage.DECODE, Stage.LOCAL)
        and _hand_off_retryable(error)
        and progress.migrations < limits.migration_limit
    ):
        return _continue(progress)
    return Fail(error)


def _continue(progress: ProgressSnapshot) -> Decision:
    """A fresh attempt: a new pair, or the decode worker alone once the client has tokens
    and no prefill worker is left."""
    if progress.first_token_sent and progress.prefill_workers_left == 0:
        return Resume()
    return Retry(RetryScope.PAIR)


@dataclass(frozen=True)
class Attempt:
    """One try at serving a request, and what the tries before it leave excluded."""

    base_id: str
    """The request's worker-facing id; fresh attempts append `~N` to it."""
    number: int = 0
    """Fresh attempts before this one (`handoff_retries`)."""
    placement: Placement | None = None
    """Fixed in advance (another prefill worker, same decode worker); None: placed anew."""
    resume: bool = False
    """Placed on a decode worker alone, to resume after the tokens sent."""
    prefill_tries: int = 1
    excluded_prefill: frozenset[str] = frozenset()
    excluded_decode: frozenset[str] = frozenset()
    migrations: int = 0
    """Fresh attempts (of `number`) made after a decode worker failed."""

    @property
    def request_id(self) -> str:
        """The id the workers see: a failed attempt's state there (a decode reservation, a
        prefill lease) ends at its own pace and must not collide with the next one's."""
        return self.base_id if self.number == 0 else f"{self.base_id}~{self.number}"

    def snapshot(self, first_token_sent: bool, prefill_workers_left: int) -> ProgressSnapshot:
        return ProgressSnapshot(
            first_token_sent,
            self.number - self.migrations,
            self.prefill_tries,
            prefill_workers_left,
            self.migrations,
        )

    def excluding_prefill(self, worker_id: str) -> Attempt:
        return replace(self, excluded_prefill=self.excluded_prefill | {worker_id})

    def another_prefill_worker(self, placement: Placement) -> Attempt:
        """Retry(PREFILL_WORKER): the same attempt on `placement` (its new prefill worker)."""
        return replace(self, placement=placement, prefill_tries=self.prefill_tries + 1)

    def fresh(
        self, excluded_decode: frozenset[str], resume: bool, migration: bool = False
    ) -> Attempt:
        """Retry(PAIR) or Resume: the next attempt, placed anew (`migration`: after its
        decode worker failed)."""
        return replace(
            self,
            number=self.number + 1,
            placement=None,
            resume=resume,
            prefill_tries=1,
            excluded_decode=excluded_decode,
            migrations=self.migrations + migration,
        )
