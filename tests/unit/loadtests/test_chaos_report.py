"""The chaos run's verdict (loadtests/chaos_run.py `_report`) over outcomes set by hand: each kind
of finding (a wrong token, a status outside the expected ones, a hang, a leak, a worker never
replaced) makes the run not clean; cancels, deadlines and refusals do not."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadtests.chaos_run import ChaosConfig, ChaosRun, Kill, Outcome


class _Target:
    """Nothing is injected: `_report` reads only what the run recorded."""

    def worker_ids(self, role: str) -> list[str]:
        return []

    def kill_worker(self, worker_id: str) -> None: ...

    def restart_redis(self) -> None: ...

    def busy_workers(self) -> dict[str, str]:
        return {}

    def migrations(self) -> float:
        return 0.0

    def unindexed_workers(self) -> list[str]:
        return []


REF = [11, 12, 13, 14]


def _run(*outcomes: Outcome, kills: tuple[Kill, ...] = ()) -> ChaosRun:
    run = ChaosRun("127.0.0.1:1", _Target(), ChaosConfig(num_prompts=1, max_tokens=4))
    run.reference = [REF]
    run.outcomes = list(outcomes)
    run.kills = list(kills)
    return run


def _ok(tokens: list[int] = REF, kind: str = "normal", status: str = "OK") -> Outcome:
    times = [1.0 + 0.01 * i for i in range(len(tokens))]
    return Outcome(0, kind, 1.0, status, list(tokens), times, 2.0, 60.0)


def test_served_cancelled_refused_and_short_deadlines_are_clean() -> None:
    report = _run(
        _ok(),
        _ok(REF[:2], "cancel", "CANCELLED"),
        _ok(REF[:1], "deadline", "DEADLINE_EXCEEDED"),
        _ok([], status="RESOURCE_EXHAUSTED"),
        replace(_ok(REF[:3], status="UNAVAILABLE"), details="decode worker lost (3 tokens)"),
        kills=(Kill("decode", "decode-1", 1.015, 4.0),),
    )._report(10.0, 20.0, 1.0, {})
    assert report.clean, report
    assert (report.sent, report.completed, report.token_mismatches) == (5, 1, 0)
    assert report.status_samples == {"UNAVAILABLE": ["decode worker lost (3 tokens)"]}
    assert report.tpot_p50_ms == pytest.approx(10.0)
    assert report.migration_gap_p50_ms == pytest.approx(10.0)  # the gap across the kill


@pytest.mark.parametrize(
    ("outcome", "finding"),
    [
        (_ok([11, 12, 99, 14]), "token_mismatches"),
        (_ok([11, 99], "cancel", "CANCELLED"), "token_mismatches"),  # a wrong prefix
        (_ok(REF[:3]), "token_mismatches"),  # "OK" with a token short
        (_ok(status="INTERNAL"), "unexpected"),
        (_ok(REF[:2], status="DEADLINE_EXCEEDED"), "hung"),  # the long deadline: a hang
        (replace(_ok(), ended_s=70.0), "hung"),
        (replace(_ok(), status=""), "hung"),  # never ended
    ],
)
def test_each_finding_makes_the_run_not_clean(outcome: Outcome, finding: str) -> None:
    report = _run(_ok(), outcome)._report(10.0, 20.0, 0.0, {})
    assert not report.clean and getattr(report, finding), report


def test_a_leak_a_stale_index_or_a_worker_never_replaced_makes_it_not_clean() -> None:
    assert not _run(_ok())._report(1.0, 2.0, 0.0, {"decode-1": "kv_used=3"}).clean
    assert not _run(_ok())._report(1.0, 2.0, 0.0, {}, ["prefill-3"]).clean
    never = Kill("prefill", "prefill-0", 5.0, None)
    assert not _run(_ok(), kills=(never,))._report(1.0, 2.0, 0.0, {}).clean


def test_bad_settings_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="duration_s"):
        ChaosConfig(duration_s=0)
    with pytest.raises(ValueError, match="cancel_share"):
        ChaosConfig(cancel_share=0.9, deadline_share=0.2)
