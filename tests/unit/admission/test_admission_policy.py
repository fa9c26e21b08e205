"""evaluate(): every reason, priorities, tenant limits, reservations and the edges between."""

from __future__ import annotations

from dataclasses import replace

import pytest
from admission_factories import (
    THRESHOLDS,
    decode,
    make_request,
    make_snapshot,
    prefill,
)

from admission.config import PolicyTuning
from admission.decision import DecisionKind, Reason
from admission.policy import ScaledLimits, evaluate
from admission.snapshot import AdmissionLedger, TenantAllowance

ADMIT, QUEUE, REJECT = DecisionKind.ADMIT, DecisionKind.QUEUE, DecisionKind.REJECT


def test_idle_cluster_admits_and_reserves_worst_case_blocks() -> None:
    d = evaluate(make_request(), make_snapshot(), THRESHOLDS)
    assert (d.kind, d.reason) == (ADMIT, Reason.ADMITTED)
    assert d.reserve_blocks == 75  # ceil((1000 + 200) / 16)
    assert d.estimated_ttft_ms == pytest.approx(100.0)  # 1000 tokens at 10k tok/s
    assert d.local_prefill is False
    assert d.retry_after_ms is None and d.max_wait_ms == 0.0


# -- local prefill (conditional disaggregation) ------------------------------------------------


def test_short_uncached_prompt_is_prefilled_locally_without_a_prefill_worker() -> None:
    d = evaluate(make_request(uncached=32), make_snapshot(prefills=()), THRESHOLDS)
    assert (d.kind, d.local_prefill, d.estimated_ttft_ms) == (ADMIT, True, 0.0)


def test_uncached_prompt_above_threshold_goes_to_a_prefill_worker() -> None:
    d = evaluate(make_request(uncached=33), make_snapshot(), THRESHOLDS)
    assert d.local_prefill is False
    assert d.estimated_ttft_ms == pytest.approx(3.3)


def test_local_prefill_skips_the_prefill_queue_and_transfer_checks() -> None:
    snapshot = make_snapshot(
        prefills=(prefill(queued=10**7),), decodes=(decode(transfer=256),), transfer_budget=256
    )
    assert evaluate(make_request(uncached=10), snapshot, THRESHOLDS).kind is ADMIT
    assert evaluate(make_request(uncached=100), snapshot, THRESHOLDS).kind is REJECT


# -- hard refusals -----------------------------------------------------------------------------


def test_no_live_decode_worker_is_rejected_with_retry() -> None:
    for decodes in [(), (decode(live=False),)]:
        d = evaluate(make_request(), make_snapshot(decodes=decodes), THRESHOLDS)
        assert (d.kind, d.reason) == (REJECT, Reason.NO_LIVE_WORKER)
        assert d.retry_after_ms == 1000.0
        assert "decode" in d.message


def test_no_live_prefill_worker_degrades_to_local_prefill() -> None:
    d = evaluate(make_request(), make_snapshot(prefills=(prefill(live=False),)), THRESHOLDS)
    assert (d.kind, d.local_prefill, d.estimated_ttft_ms) == (ADMIT, True, 0.0)


def test_request_larger_than_any_decode_worker_is_rejected_without_retry() -> None:
    snapshot = make_snapshot(decodes=(decode(total=100), decode("d1", total=50)))
    # floor(100 * 0.9) = 90 blocks = 1440 tokens is the most one request may hold.
    fits = make_request(prompt_tokens=1240, max_tokens=200)
    assert evaluate(fits, snapshot, THRESHOLDS).kind is ADMIT
    too_big = make_request(prompt_tokens=1241, max_tokens=200)
    d = evaluate(too_big, snapshot, THRESHOLDS)
    assert (d.kind, d.reason, d.retry_after_ms) == (REJECT, Reason.REQUEST_TOO_LARGE, None)
    assert d.reserve_blocks == 91
    assert "91 KV blocks" in d.message and "90" in d.message


def test_too_large_ignores_dead_workers() -> None:
    snapshot = make_snapshot(decodes=(decode(total=10_000, live=False), decode("d1", total=50)))
    d = evaluate(make_request(), snapshot, THRESHOLDS)
    assert d.reason is Reason.REQUEST_TOO_LARGE


def test_deadline_before_estimated_ttft_is_rejected_without_retry() -> None:
    snapshot = make_snapshot()  # estimated TTFT 100 ms
    assert evaluate(make_request(deadline_ms=101), snapshot, THRESHOLDS).kind is ADMIT
    for deadline in (100.0, 0.0, -5.0):
        d = evaluate(make_request(deadline_ms=deadline), snapshot, THRESHOLDS)
        assert (d.kind, d.reason, d.retry_after_ms) == (
            REJECT,
            Reason.DEADLINE_UNREACHABLE,
            None,
        )


# -- tenant rate limits ------------------------------------------------------------------------


def test_tenant_short_of_tokens_is_rejected_with_time_to_refill() -> None:
    tenant = TenantAllowance(available_tokens=500, tokens_per_s=1000, burst_tokens=10_000)
    d = evaluate(make_request(tenant="acme"), make_snapshot(), THRESHOLDS, tenant=tenant)
    assert (d.kind, d.reason) == (REJECT, Reason.TENANT_RATE_LIMITED)
    assert d.retry_after_ms == pytest.approx(700.0)  # (1200 - 500) tokens at 1000 tokens/s
    assert "'acme'" in d.message
    assert "tokens_per_s 1000, burst_tokens 10000" in d.message  # names the limit


def test_tenant_at_its_inflight_limit_is_rejected_before_its_rate_is_looked_at() -> None:
    tenant = TenantAllowance(inflight_requests=3, max_inflight_requests=3)
    d = evaluate(make_request(tenant="acme"), make_snapshot(), THRESHOLDS, tenant=tenant)
    assert (d.kind, d.reason) == (REJECT, Reason.TENANT_INFLIGHT_LIMIT)
    assert "max_inflight_requests 3" in d.message and "'acme'" in d.message
    assert d.retry_after_ms == 1000.0  # the default hint: when a request ends is unknown
    below = replace(tenant, inflight_requests=2)
    assert evaluate(make_request(), make_snapshot(), THRESHOLDS, tenant=below).kind is ADMIT


def test_tenant_with_enough_tokens_is_admitted() -> None:
    tenant = TenantAllowance(available_tokens=1200, tokens_per_s=1000, burst_tokens=10_000)
    d = evaluate(make_request(), make_snapshot(), THRESHOLDS, tenant=tenant)
    assert d.kind is ADMIT


def test_request_larger_than_the_bucket_needs_only_a_full_bucket() -> None:
    full = TenantAllowance(available_tokens=1000, tokens_per_s=100, burst_tokens=1000)
    assert evaluate(make_request(), make_snapshot(), THRESHOLDS, tenant=full).kind is ADMIT
    almost = replace(full, available_tokens=999.9)
    d = evaluate(make_request(), make_snapshot(), THRESHOLDS, tenant=almost)
    assert d.reason is Reason.TENANT_RATE_LIMITED
    assert d.retry_after_ms == 50.0  # 1 ms, raised to the floor of every hint


def test_tenant_in_debt_waits_for_the_debt_and_the_request() -> None:
    debt = TenantAllowance(available_tokens=-2000, tokens_per_s=1000, burst_tokens=5000)
    d = evaluate(make_request(), make_snapshot(), THRESHOLDS, tenant=debt)
    assert d.retry_after_ms == pytest.approx(3200.0)


def test_tenant_limit_is_checked_before_overload() -> None:
    tenant = TenantAllowance(available_tokens=0, tokens_per_s=1000, burst_tokens=10_000)
    d = evaluate(make_request(), make_snapshot(inflight=100), THRESHOLDS, tenant=tenant)
    assert d.reason is Reason.TENANT_RATE_LIMITED


# -- estimated TTFT ----------------------------------------------------------------------------


def test_ttft_slightly_over_budget_queues_for_the_queue_wait() -> None:
    # (10000 queued + 1000) / 10k tok/s = 1100 ms: 100 ms over, drains within the 500 ms wait.
    d = evaluate(make_request(), make_snapshot(prefills=(prefill(queued=10_000),)), THRESHOLDS)
    assert (d.kind, d.reason) == (QUEUE, Reason.TTFT_OVER_BUDGET)
    assert d.max_wait_ms == 500.0
    assert d.estimated_ttft_ms == pytest.approx(1100.0)
    assert "1100 ms exceeds 1000 ms" in d.message


def test_ttft_far_over_budget_is_rejected_with_the_excess_as_retry_after() -> None:
    d = evaluate(make_request(), make_snapshot(prefills=(prefill(queued=20_000),)), THRESHOLDS)
    assert (d.kind, d.reason) == (REJECT, Reason.TTFT_OVER_BUDGET)
    assert d.retry_after_ms == pytest.approx(1100.0)


def test_ttft_estimate_uses_the_best_live_prefill_worker() -> None:
    workers = (prefill("busy", queued=50_000), prefill("idle", tps=5_000))
    d = evaluate(make_request(), make_snapshot(prefills=workers), THRESHOLDS)
    assert (d.kind, d.estimated_ttft_ms) == (ADMIT, pytest.approx(200.0))
    workers = (prefill("busy", queued=50_000), prefill("idle", live=False))
    d = evaluate(make_request(), make_snapshot(prefills=workers), THRESHOLDS)
    assert d.estimated_ttft_ms == pytest.approx(5100.0)


def test_ttft_exactly_at_the_limit_is_admitted() -> None:
    d = evaluate(make_request(), make_snapshot(prefills=(prefill(queued=9_000),)), THRESHOLDS)
    assert d.kind is ADMIT


def test_uncached_tokens_not_prompt_tokens_drive_the_ttft_estimate() -> None:
    snapshot = make_snapshot(prefills=(prefill(queued=9_500),))
    assert evaluate(make_request(uncached=500), snapshot, THRESHOLDS).kind is ADMIT
    assert evaluate(make_request(uncached=1000), snapshot, THRESHOLDS).kind is QUEUE


def test_zero_queue_wait_rejects_every_overload() -> None:
    thresholds = replace(THRESHOLDS, max_queue_wait_ms=0.0)
    d = evaluate(make_request(), make_snapshot(inflight=100), thresholds)
    assert (d.kind, d.reason, d.retry_after_ms) == (REJECT, Reason.INFLIGHT_LIMIT, 1000.0)


# -- in-flight limit ---------------------------------------------------------------------------


def test_inflight_limit_queues_with_unknown_clear_time() -> None:
    assert evaluate(make_request(), make_snapshot(inflight=99), THRESHOLDS).kind is ADMIT
    d = evaluate(make_request(), make_snapshot(inflight=100), THRESHOLDS)
    assert (d.kind, d.reason, d.max_wait_ms) == (QUEUE, Reason.INFLIGHT_LIMIT, 500.0)
    assert "100 requests in flight (limit 100)" in d.message


def test_inflight_counts_the_larger_of_router_and_ledger() -> None:
    ledger = AdmissionLedger(admitted_requests=100)
    d = evaluate(make_request(), make_snapshot(inflight=3), THRESHOLDS, ledger=ledger)
    assert d.reason is Reason.INFLIGHT_LIMIT


# -- decode KV ---------------------------------------------------------------------------------


def test_reservation_budget_counts_the_controllers_reservations() -> None:
    # 0.9 * 1000 = 900 blocks may be reserved; the request needs 75.
    ok = AdmissionLedger(reserved_blocks=825)
    assert evaluate(make_request(), make_snapshot(), THRESHOLDS, ledger=ok).kind is ADMIT
    full = AdmissionLedger(reserved_blocks=826)
    d = evaluate(make_request(), make_snapshot(), THRESHOLDS, ledger=full)
    assert (d.kind, d.reason) == (QUEUE, Reason.DECODE_KV_FULL)
    assert "826 + 75 blocks exceed 900" in d.message


def test_reservation_budget_spans_live_decode_workers_only() -> None:
    decodes = (decode("d0"), decode("d1", live=False))
    ledger = AdmissionLedger(reserved_blocks=850)
    d = evaluate(make_request(), make_snapshot(decodes=decodes), THRESHOLDS, ledger=ledger)
    assert d.reason is Reason.DECODE_KV_FULL
    decodes = (decode("d0"), decode("d1"))
    d = evaluate(make_request(), make_snapshot(decodes=decodes), THRESHOLDS, ledger=ledger)
    assert d.kind is ADMIT


def test_a_single_decode_worker_must_have_room_for_the_whole_request() -> None:
    # Each has 900 - 800 used - 30 reserved = 70 blocks of headroom: 140 in all, 75 needed.
    decodes = (decode("d0", free=200, reserved=30), decode("d1", free=200, reserved=30))
    d = evaluate(make_request(), make_snapshot(decodes=decodes), THRESHOLDS)
    assert (d.kind, d.reason) == (QUEUE, Reason.DECODE_KV_FULL)
    assert "no decode worker has 75 free KV blocks" in d.message and "best has 70" in d.message
    decodes = (decode("d0", free=200, reserved=30), decode("d1", free=200, reserved=25))
    assert evaluate(make_request(), make_snapshot(decodes=decodes), THRESHOLDS).kind is ADMIT


def test_worker_reserved_blocks_count_as_used() -> None:
    decodes = (decode(free=1000, reserved=826),)
    d = evaluate(make_request(), make_snapshot(decodes=decodes), THRESHOLDS)
    assert d.reason is Reason.DECODE_KV_FULL


def test_overcommitted_worker_reports_zero_headroom_in_the_message() -> None:
    decodes = (decode(free=0, reserved=500),)
    d = evaluate(make_request(), make_snapshot(decodes=decodes), THRESHOLDS)
    assert "best has 0" in d.message


# -- KV transfer budget ------------------------------------------------------------------------


def test_transfer_budget_in_use_on_every_decode_worker_queues() -> None:
    # The request pulls ceil(1000 / 16) = 63 blocks; budget 256.
    ok = make_snapshot(decodes=(decode(transfer=193),))
    assert evaluate(make_request(), ok, THRESHOLDS).kind is ADMIT
    busy = make_snapshot(decodes=(decode(transfer=194), decode("d1", transfer=250)))
    d = evaluate(make_request(), busy, THRESHOLDS)
    assert (d.kind, d.reason) == (QUEUE, Reason.TRANSFER_BUDGET)
    assert "194 + 63 blocks > 256" in d.message


def test_one_decode_worker_with_transfer_room_is_enough() -> None:
    snapshot = make_snapshot(decodes=(decode(transfer=250), decode("d1", transfer=0)))
    assert evaluate(make_request(), snapshot, THRESHOLDS).kind is ADMIT


def test_oversized_pull_may_start_only_when_nothing_is_in_flight() -> None:
    idle = make_snapshot(decodes=(decode(transfer=0),), transfer_budget=10)
    assert evaluate(make_request(), idle, THRESHOLDS).kind is ADMIT
    busy = make_snapshot(decodes=(decode(transfer=1),), transfer_budget=10)
    assert evaluate(make_request(), busy, THRESHOLDS).reason is Reason.TRANSFER_BUDGET


# -- queue order, queue bound, deadlines while queued ------------------------------------------


def test_request_queues_behind_waiters_that_go_first() -> None:
    ledger = AdmissionLedger(waiting_requests=3, waiting_ahead=2)
    d = evaluate(make_request(), make_snapshot(), THRESHOLDS, ledger=ledger)
    assert (d.kind, d.reason) == (QUEUE, Reason.WAITING_AHEAD)
    assert d.message == "2 queued requests go first"


def test_full_queue_rejects_instead_of_queueing() -> None:
    tuning = PolicyTuning(max_waiting_requests=4)
    ledger = AdmissionLedger(waiting_requests=4, waiting_ahead=4)
    d = evaluate(make_request(), make_snapshot(), THRESHOLDS, ledger=ledger, tuning=tuning)
    assert (d.kind, d.reason, d.retry_after_ms) == (REJECT, Reason.QUEUE_FULL, 1000.0)
    assert "queue is full (4 waiting)" in d.message
    ledger = AdmissionLedger(waiting_requests=3, waiting_ahead=3)
    d = evaluate(make_request(), make_snapshot(), THRESHOLDS, ledger=ledger, tuning=tuning)
    assert d.kind is QUEUE


def test_full_queue_does_not_matter_when_there_is_capacity() -> None:
    tuning = PolicyTuning(max_waiting_requests=0)
    ledger = AdmissionLedger(waiting_requests=5, waiting_ahead=0)
    d = evaluate(make_request(), make_snapshot(), THRESHOLDS, ledger=ledger, tuning=tuning)
    assert d.kind is ADMIT


def test_deadline_shortens_the_queue_wait() -> None:
    d = evaluate(make_request(deadline_ms=300), make_snapshot(inflight=100), THRESHOLDS)
    assert (d.kind, d.max_wait_ms) == (QUEUE, pytest.approx(200.0))  # 300 - 100 ms TTFT


def test_deadline_too_close_for_the_ttft_backlog_to_drain_rejects() -> None:
    snapshot = make_snapshot(prefills=(prefill(queued=10_000),))  # est 1100 ms, 100 ms over
    d = evaluate(make_request(deadline_ms=1200), snapshot, THRESHOLDS)
    assert (d.kind, d.max_wait_ms) == (QUEUE, pytest.approx(100.0))
    d = evaluate(make_request(deadline_ms=1150), snapshot, THRESHOLDS)
    assert (d.kind, d.reason) == (REJECT, Reason.TTFT_OVER_BUDGET)


# -- several limits at once --------------------------------------------------------------------


def test_first_blocking_limit_names_the_reason_and_the_message_lists_all() -> None:
    snapshot = make_snapshot(
        prefills=(prefill(queued=10_000),), decodes=(decode(transfer=250),), inflight=100
    )
    ledger = AdmissionLedger(reserved_blocks=900, waiting_requests=1, waiting_ahead=1)
    d = evaluate(make_request(), snapshot, THRESHOLDS, ledger=ledger)
    assert (d.kind, d.reason) == (QUEUE, Reason.INFLIGHT_LIMIT)
    parts = d.message.split("; ")
    assert [p.split()[0] for p in parts] == ["100", "decode", "KV", "estimated", "1"]


def test_rejection_retry_after_is_the_longest_known_clear_time() -> None:
    snapshot = make_snapshot(prefills=(prefill(queued=30_000),), inflight=100)
    d = evaluate(make_request(), snapshot, THRESHOLDS)
    assert (d.kind, d.reason) == (REJECT, Reason.TTFT_OVER_BUDGET)
    assert d.retry_after_ms == pytest.approx(2100.0)


def test_retry_after_is_capped() -> None:
    snapshot = make_snapshot(prefills=(prefill(queued=10**9),))
    d = evaluate(make_request(), snapshot, THRESHOLDS)
    assert d.retry_after_ms == 30_000.0


# -- priorities --------------------------------------------------------------------------------


def test_limits_scale_with_priority() -> None:
    tuning = PolicyTuning(priority_step=0.05)
    high = ScaledLimits.for_priority(THRESHOLDS, 10, tuning)
    assert high == ScaledLimits(1500.0, 750.0, 150, 1.0)  # KV utilization capped at 1
    low = ScaledLimits.for_priority(THRESHOLDS, -10, tuning)
    assert (low.max_ttft_ms, low.max_queue_wait_ms, low.max_inflight) == (500.0, 250.0, 50)
    assert low.max_kv_utilization == pytest.approx(0.45)
    assert ScaledLimits.for_priority(THRESHOLDS, 0, tuning) == ScaledLimits(1000.0, 500.0, 100, 0.9)


def test_higher_priority_is_admitted_where_normal_priority_queues() -> None:
    snapshot = make_snapshot(prefills=(prefill(queued=10_000),))  # est 1100 ms
    assert evaluate(make_request(priority=0), snapshot, THRESHOLDS).kind is QUEUE
    assert evaluate(make_request(priority=2), snapshot, THRESHOLDS).kind is ADMIT


def test_lower_priority_is_shed_first() -> None:
    snapshot = make_snapshot(prefills=(prefill(queued=5_000),))  # est 600 ms
    assert evaluate(make_request(priority=0), snapshot, THRESHOLDS).kind is ADMIT
    d = evaluate(make_request(priority=-10), snapshot, THRESHOLDS)  # limit 500, wait 250
    assert (d.kind, d.max_wait_ms) == (QUEUE, 250.0)
    snapshot = make_snapshot(prefills=(prefill(queued=7_000),))  # est 800: 300 over, > 250
    assert evaluate(make_request(priority=-10), snapshot, THRESHOLDS).kind is REJECT


def test_priority_scales_inflight_and_kv_limits() -> None:
    snapshot = make_snapshot(inflight=100)
    assert evaluate(make_request(priority=1), snapshot, THRESHOLDS).kind is ADMIT  # limit 105
    snapshot = make_snapshot(inflight=95)
    assert evaluate(make_request(priority=-1), snapshot, THRESHOLDS).kind is QUEUE  # limit 95
    ledger = AdmissionLedger(reserved_blocks=900)  # at the 0.9 budget
    d = evaluate(make_request(priority=3), make_snapshot(), THRESHOLDS, ledger=ledger)
    assert d.kind is ADMIT  # 0.9 * 1.15 = 1.035, capped at 1.0: 1000 blocks


def test_priority_lets_a_request_fit_in_the_headroom_above_the_utilization_limit() -> None:
    snapshot = make_snapshot(decodes=(decode(total=100),))
    request = make_request(prompt_tokens=1320, max_tokens=200)  # 95 blocks; limit 90 at p0
    assert evaluate(request, snapshot, THRESHOLDS).reason is Reason.REQUEST_TOO_LARGE
    assert evaluate(replace(request, priority=10), snapshot, THRESHOLDS).kind is ADMIT


def test_zero_priority_step_makes_priorities_only_an_ordering() -> None:
    tuning = PolicyTuning(priority_step=0.0)
    snapshot = make_snapshot(prefills=(prefill(queued=10_000),))
    d = evaluate(make_request(priority=10), snapshot, THRESHOLDS, tuning=tuning)
    assert d.kind is QUEUE


# -- block size --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "block_size", "blocks"),
    [(1, 1, 16, 1), (15, 1, 16, 1), (16, 1, 16, 2), (1000, 24, 16, 64), (1000, 200, 1, 1200)],
)
def test_reserved_blocks_round_up_to_whole_blocks(
    prompt: int, max_tokens: int, block_size: int, blocks: int
) -> None:
    request = make_request(prompt_tokens=prompt, max_tokens=max_tokens)
    snapshot = make_snapshot(decodes=(decode(total=10_000),), block_size=block_size)
    assert evaluate(request, snapshot, THRESHOLDS).reserve_blocks == blocks


def test_evaluate_is_pure() -> None:
    request, snapshot = make_request(), make_snapshot(inflight=100)
    ledger = AdmissionLedger(reserved_blocks=10)
    first = evaluate(request, snapshot, THRESHOLDS, ledger=ledger)
    assert all(evaluate(request, snapshot, THRESHOLDS, ledger=ledger) == first for _ in range(3))
    assert ledger == AdmissionLedger(reserved_blocks=10)
