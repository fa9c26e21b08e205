"""The recovery policy (`router.recovery.decide`) over every failure type in every stage, its
limits at their edges, and the attempts its decisions make."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from admission.decision import AdmissionRejected, Reason
from router.errors import StageTimeout, WorkerLost, to_grpc_failure
from router.placement import NoWorkerError, Placement
from router.recovery import (
    Attempt,
    Decision,
    Fail,
    Failure,
    ProgressSnapshot,
    RecoveryLimits,
    Resume,
    Retry,
    RetryScope,
    Stage,
    decide,
    is_worker_fault,
)
from vocabulary.transfer_errors import TransferError, TransferTimeout
from vocabulary.worker_api import (
    RequestAborted,
    RequestDeadlineExceeded,
    StepFailed,
    WorkerDraining,
    WorkerOverloaded,
    WorkerStopped,
)

LIMITS = RecoveryLimits(max_handoff_retries=1, max_prefill_attempts=3)
FRESH = ProgressSnapshot(
    first_token_sent=True, handoff_retries=0, prefill_tries=1, prefill_workers_left=1
)
"""An attempt with room for every kind of retry."""

WORKER_FAULTS: list[BaseException] = [
    WorkerDraining("draining"),
    WorkerOverloaded("full"),
    WorkerStopped("stopped"),
    StepFailed("engine step failed"),
    RayActorError(),
    ActorDiedError(),
    ActorUnavailableError("unavailable", None),
]
HAND_OFF_ONLY: list[BaseException] = [
    TransferError("pull failed"),
    TransferTimeout("lease expired"),
    WorkerLost("decode worker left"),
    StageTimeout("hand-off: worker decode-1 did not answer within 90s"),
]
NEVER_RETRIED: list[BaseException] = [
    RequestDeadlineExceeded("request deadline passed"),
    RequestAborted("aborted"),
    NoWorkerError("decode"),
    AdmissionRejected(Reason.QUEUE_FULL, "full", 100.0),
    asyncio.CancelledError(),
    GeneratorExit(),
    ValueError("a bug"),
]


def decision(stage: Stage, error: BaseException, progress: ProgressSnapshot = FRESH) -> Decision:
    return decide(Failure(stage, error, "worker-0"), progress, LIMITS)


# ---- every failure type, stage by stage --------------------------------------------------


@pytest.mark.parametrize("error", WORKER_FAULTS + HAND_OFF_ONLY + NEVER_RETRIED, ids=repr)
def test_a_failure_in_placement_fails_as_it_is(error: BaseException) -> None:
    assert decision(Stage.PLACE, error) == Fail(error)


@pytest.mark.parametrize("error", WORKER_FAULTS + HAND_OFF_ONLY, ids=repr)
@pytest.mark.parametrize("stage", [Stage.DECODE, Stage.LOCAL])
def test_a_decode_worker_fault_migrates_the_running_request(
    stage: Stage, error: BaseException
) -> None:
    assert decision(stage, error) == Retry(RetryScope.PAIR)
    # no prefill worker left: the tokens sent are resumed after on a decode worker alone
    assert decision(stage, error, replace(FRESH, prefill_workers_left=0)) == Resume()
    # nothing sent yet (a local prefill): placed anew, maybe on a decode worker alone
    nothing = replace(FRESH, first_token_sent=False, prefill_workers_left=0)
    assert decision(stage, error, nothing) == Retry(RetryScope.PAIR)


@pytest.mark.parametrize("stage", [Stage.DECODE, Stage.LOCAL])
def test_migrations_stop_at_the_limit_and_hand_off_retries_do_not_count(stage: Stage) -> None:
    error = WorkerLost("decode worker decode-1 lost")
    limits = RecoveryLimits(max_handoff_retries=1, migration_limit=2)
    failure = Failure(stage, error, "decode-1")
    got = [
        decide(failure, replace(FRESH, migrations=n, handoff_retries=1), limits) for n in range(3)
    ]
    assert got == [Retry(RetryScope.PAIR)] * 2 + [Fail(error)]
    assert decide(failure, FRESH, RecoveryLimits(migration_limit=0)) == Fail(error)


@pytest.mark.parametrize("error", NEVER_RETRIED, ids=repr)
@pytest.mark.parametrize("stage", [Stage.DECODE, Stage.LOCAL])
def test_a_deadline_a_cancel_or_a_bad_request_while_decoding_fails_as_it_is(
    stage: Stage, error: BaseException
) -> None:
    assert decision(stage, error) == Fail(error)


@pytest.mark.parametrize("error", WORKER_FAULTS, ids=repr)
def test_a_prefill_worker_fault_moves_the_prefill_to_another_worker(error: BaseException) -> None:
    assert is_worker_fault(error)
    assert decision(Stage.PREFILL, error) == Retry(RetryScope.PREFILL_WORKER)


@pytest.mark.parametrize("error", HAND_OFF_ONLY + NEVER_RETRIED, ids=repr)
def test_any_other_prefill_failure_fails_as_it_is(error: BaseException) -> None:
    assert not is_worker_fault(error)
    assert decision(Stage.PREFILL, error) == Fail(error)


@pytest.mark.parametrize("error", WORKER_FAULTS + HAND_OFF_ONLY, ids=repr)
def test_a_hand_off_failure_is_retried_on_a_fresh_pair(error: BaseException) -> None:
    assert decision(Stage.HAND_OFF, error) == Retry(RetryScope.PAIR)


@pytest.mark.parametrize("error", NEVER_RETRIED, ids=repr)
def test_a_deadline_a_cancel_or_a_bad_request_in_the_hand_off_fails(error: BaseException) -> None:
    assert decision(Stage.HAND_OFF, error) == Fail(error)


# ---- the limits and what is left ---------------------------------------------------------


@pytest.mark.parametrize("error", WORKER_FAULTS + HAND_OFF_ONLY, ids=repr)
def test_a_hand_off_failure_with_no_prefill_worker_left_resumes_on_the_decode_worker(
    error: BaseException,
) -> None:
    assert decision(Stage.HAND_OFF, error, replace(FRESH, prefill_workers_left=0)) == Resume()


def test_with_nothing_sent_and_no_prefill_worker_left_a_hand_off_retries_the_pair() -> None:
    # (nothing to resume after: the fresh attempt is placed on a decode worker alone)
    progress = replace(FRESH, first_token_sent=False, prefill_workers_left=0)
    assert decision(Stage.HAND_OFF, TransferError("x"), progress) == Retry(RetryScope.PAIR)


@pytest.mark.parametrize("workers_left", [0, 1])
def test_a_hand_off_failure_after_the_last_retry_fails_as_it_is(workers_left: int) -> None:
    error = TransferTimeout("lease expired")
    progress = replace(FRESH, handoff_retries=1, prefill_workers_left=workers_left)
    assert decision(Stage.HAND_OFF, error, progress) == Fail(error)


def test_more_hand_off_retries_when_the_limit_allows() -> None:
    limits = RecoveryLimits(max_handoff_retries=3)
    failure = Failure(Stage.HAND_OFF, TransferError("x"), "decode-1")
    got = [decide(failure, replace(FRESH, handoff_retries=n), limits) for n in range(4)]
    assert got == [Retry(RetryScope.PAIR)] * 3 + [Fail(failure.error)]


@pytest.mark.parametrize(
    ("tries", "left", "retried"),
    [(1, 1, True), (2, 5, True), (3, 5, False), (1, 0, False), (4, 1, False)],
)
def test_a_prefill_worker_fault_fails_unavailable_once_tries_or_workers_run_out(
    tries: int, left: int, retried: bool
) -> None:
    error = WorkerDraining("prefill-0 is draining")
    progress = replace(FRESH, prefill_tries=tries, prefill_workers_left=left)
    got = decide(Failure(Stage.PREFILL, error, "prefill-0"), progress, LIMITS)
    if retried:
        assert got == Retry(RetryScope.PREFILL_WORKER)
        return
    assert isinstance(got, Fail) and isinstance(got.error, WorkerLost)
    assert str(got.error) == "prefill worker prefill-0: prefill-0 is draining"
    assert to_grpc_failure(got.error).code.name == "UNAVAILABLE"


def test_the_prefill_stage_does_not_look_at_hand_off_retries_or_the_first_token() -> None:
    progress = ProgressSnapshot(
        first_token_sent=False, handoff_retries=5, prefill_tries=1, prefill_workers_left=1
    )
    assert decision(Stage.PREFILL, StepFailed("x"), progress) == Retry(RetryScope.PREFILL_WORKER)


# ---- the attempts the decisions make -----------------------------------------------------

PLACED = Placement("decode-1", "prefill-0", cached_blocks=0, uncached_tokens=38)


def test_fresh_attempts_get_fresh_worker_facing_ids_and_keep_the_exclusions() -> None:
    first = Attempt("client-1@ab.0").excluding_prefill("prefill-0")
    assert first.request_id == "client-1@ab.0"
    second = first.fresh(frozenset({"decode-1"}), resume=False)
    third = second.fresh(frozenset(), resume=True)
    assert [second.request_id, third.request_id] == ["client-1@ab.0~1", "client-1@ab.0~2"]
    assert second.excluded_prefill == third.excluded_prefill == frozenset({"prefill-0"})
    assert second.excluded_decode == frozenset({"decode-1"}) and third.excluded_decode == set()
    assert (second.resume, third.resume) == (False, True)
    assert second.snapshot(True, 2) == ProgressSnapshot(True, 1, 1, 2)
    # a migration is a fresh attempt that counts against the migration limit instead
    migrated = third.fresh(frozenset({"decode-2"}), resume=False, migration=True)
    assert migrated.request_id == "client-1@ab.0~3"
    assert migrated.snapshot(True, 1) == ProgressSnapshot(True, 2, 1, 1, migrations=1)


def test_another_prefill_worker_is_the_same_attempt_on_a_fixed_placement() -> None:
    attempt = Attempt("r").fresh(frozenset(), resume=False)
    moved = attempt.another_prefill_worker(replace(PLACED, prefill_worker_id="prefill-1"))
    assert moved.request_id == "r~1" and moved.number == 1
    assert moved.placement is not None and moved.placement.prefill_worker_id == "prefill-1"
    assert moved.snapshot(True, 0).prefill_tries == 2
    again = moved.fresh(frozenset(), resume=False)  # a fresh attempt is placed anew
    assert again.placement is None and again.prefill_tries == 1 and again.request_id == "r~2"
