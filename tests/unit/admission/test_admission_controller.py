"""AdmissionController on a real event loop: queue -> admit on release, bounded waits, priority
order, run-time thresholds and no reservation leaks on cancel."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest
from admission_factories import THRESHOLDS, make_request, make_snapshot, prefill

from admission.config import AdmissionConfig, AdmissionThresholds, TenantLimit
from admission.controller import AdmissionController, RequestState
from admission.decision import Admission, AdmissionRejected, DuplicateRequestId, Reason
from admission.snapshot import ClusterSnapshot

ONE_AT_A_TIME = replace(THRESHOLDS, max_inflight_requests=1, max_queue_wait_ms=5000.0)


def run(make: Callable[[], Awaitable[Any]]) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(make(), timeout=10.0)  # a hang fails, never blocks CI

    return asyncio.run(bounded())


def controller(thresholds: AdmissionThresholds = ONE_AT_A_TIME, **kw: Any) -> AdmissionController:
    kw.setdefault("recheck_interval_ms", 10_000.0)  # only explicit wake-ups, unless a test asks
    return AdmissionController(AdmissionConfig(thresholds=thresholds, **kw))


class Cluster:
    """A snapshot provider the test changes under the controller's feet."""

    def __init__(self, snapshot: ClusterSnapshot | None = None) -> None:
        self.snapshot = snapshot or make_snapshot()
        self.calls = 0

    def __call__(self) -> ClusterSnapshot:
        self.calls += 1
        return self.snapshot


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_idle_cluster_admits_at_once_and_reserves_blocks() -> None:
    async def scenario() -> None:
        ctl = controller()
        ticket = await ctl.admit(make_request("a"), Cluster())
        assert ticket == Admission("a", 75, 1200, False, 100.0, 0.0)
        stats = ctl.stats()
        assert (stats.admitted_now, stats.reserved_blocks, stats.admitted_total) == (1, 75, 1)
        assert ctl.release("a") is True
        assert ctl.stats().reserved_blocks == 0

    run(scenario)


def test_policy_rejection_raises_at_once_and_reserves_nothing() -> None:
    async def scenario() -> None:
        ctl = controller()
        busy = Cluster(make_snapshot(prefills=(prefill(queued=10**6),)))
        with pytest.raises(AdmissionRejected) as err:
            await ctl.admit(make_request("a"), busy)
        assert err.value.reason is Reason.TTFT_OVER_BUDGET
        assert err.value.retry_after_ms == 30_000.0
        assert "estimated TTFT" in err.value.message
        stats = ctl.stats()
        assert (stats.admitted_now, stats.waiting_now, stats.reserved_blocks) == (0, 0, 0)
        assert stats.rejected_total == {Reason.TTFT_OVER_BUDGET: 1}

    run(scenario)


def test_queued_request_is_admitted_when_capacity_is_released() -> None:
    async def scenario() -> None:
        ctl, cluster = controller(), Cluster()
        await ctl.admit(make_request("a"), cluster)
        waiting = asyncio.create_task(ctl.admit(make_request("b"), cluster))
        await settle()
        assert not waiting.done()
        assert (ctl.stats().waiting_now, ctl.stats().queued_total) == (1, 1)
        await asyncio.sleep(0.02)
        ctl.release("a")
        ticket = await asyncio.wait_for(waiting, 1.0)  # woken by release, not the 10 s recheck
        assert ticket.request_id == "b" and ticket.queued_ms >= 15.0
        assert (ctl.stats().admitted_now, ctl.stats().waiting_now) == (1, 0)
        assert ctl.stats().reserved_blocks == 75

    run(scenario)


def test_bounded_wait_running_out_raises_queue_timeout_and_never_hangs() -> None:
    async def scenario() -> None:
        ctl, cluster = controller(replace(ONE_AT_A_TIME, max_queue_wait_ms=50.0)), Cluster()
        await ctl.admit(make_request("a"), cluster)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(AdmissionRejected) as err:
            await ctl.admit(make_request("b"), cluster)
        assert 0.045 <= loop.time() - start < 1.0
        assert err.value.reason is Reason.QUEUE_TIMEOUT
        assert err.value.retry_after_ms == 1000.0
        assert "in flight" in err.value.message
        stats = ctl.stats()
        assert (stats.waiting_now, stats.admitted_now, stats.reserved_blocks) == (0, 1, 75)
        assert stats.rejected_total == {Reason.QUEUE_TIMEOUT: 1}

    run(scenario)


def test_deadline_bounds_the_wait_of_a_queued_request() -> None:
    async def scenario() -> None:
        ctl, cluster = controller(), Cluster()
        await ctl.admit(make_request("a"), cluster)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(AdmissionRejected):
            await ctl.admit(make_request("b", deadline_ms=160.0), cluster)  # 160 - 100 est
        assert 0.055 <= loop.time() - start < 1.0

    run(scenario)


def test_queue_is_served_by_priority_then_arrival() -> None:
    async def scenario() -> None:
        ctl, cluster = controller(), Cluster()
        await ctl.admit(make_request("first"), cluster)
        order: list[str] = []

        async def admit(rid: str, priority: int) -> None:
            ticket = await ctl.admit(make_request(rid, priority=priority), cluster)
            order.append(ticket.request_id)

        tasks = []
        for rid, priority in [("b", 0), ("c", 0), ("d", 5), ("e", -3), ("f", 5)]:
            tasks.append(asyncio.create_task(admit(rid, priority)))
            await settle()
        assert ctl.stats().waiting_now == 5
        previous = "first"
        for _ in range(5):
            ctl.release(previous)
            await settle()
            previous = order[-1]
        assert order == ["d", "f", "b", "c", "e"]
        await asyncio.gather(*tasks)

    run(scenario)


def test_newcomer_does_not_overtake_an_equal_priority_head_that_waits_for_kv() -> None:
    async def scenario() -> None:
        ctl = controller(replace(THRESHOLDS, max_queue_wait_ms=5000.0))
        cluster = Cluster()
        # "a" holds 750 of the 900 reservable blocks (prefilled locally: no TTFT estimate).
        await ctl.admit(make_request("a", prompt_tokens=11_800, uncached=0), cluster)
        big = asyncio.create_task(ctl.admit(make_request("big", prompt_tokens=3000), cluster))
        await settle()
        small = asyncio.create_task(ctl.admit(make_request("small", prompt_tokens=100), cluster))
        await settle()
        assert not big.done() and not small.done()  # small (19 blocks) would fit, but queues
        order: list[str] = []
        big.add_done_callback(lambda _: order.append("big"))
        small.add_done_callback(lambda _: order.append("small"))
        ctl.release("a")
        await settle()
        assert order == ["big", "small"]
        assert ctl.stats().reserved_blocks == 200 + 19

    run(scenario)


def test_higher_priority_newcomer_is_admitted_past_lower_priority_waiters() -> None:
    async def scenario() -> None:
        ctl = controller(replace(THRESHOLDS, max_queue_wait_ms=5000.0))
        cluster = Cluster()
        await ctl.admit(make_request("a", prompt_tokens=11_800, uncached=0), cluster)
        low = asyncio.create_task(ctl.admit(make_request("low", prompt_tokens=3000), cluster))
        await settle()
        ticket = await ctl.admit(make_request("vip", prompt_tokens=100, priority=1), cluster)
        assert ticket.request_id == "vip" and not low.done()
        low.cancel()
        await settle()

    run(scenario)


def test_cancel_while_queued_leaves_nothing_reserved_or_queued() -> None:
    async def scenario() -> None:
        ctl, cluster = controller(), Cluster()
        await ctl.admit(make_request("a"), cluster)
        waiting = asyncio.create_task(ctl.admit(make_request("b"), cluster))
        await settle()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert (ctl.stats().waiting_now, ctl.stats().reserved_blocks) == (0, 75)
        ctl.release("a")
        assert (ctl.stats().admitted_now, ctl.stats().reserved_blocks) == (0, 0)
        # The id is free again.
        await ctl.admit(make_request("b"), cluster)

    run(scenario)


def test_cancel_in_the_instant_of_admission_releases_the_reservation() -> None:
    async def scenario() -> None:
        ctl, cluster = controller(), Cluster()
        await ctl.admit(make_request("a"), cluster)
        waiting = asyncio.create_task(ctl.admit(make_request("b"), cluster))
        await settle()
        ctl.release("a")  # admits "b" synchronously ...
        assert ctl.stats().admitted_now == 1
        waiting.cancel()  # ... but its caller goes away before it resumes
        with pytest.raises(asyncio.CancelledError):
            await waiting
        stats = ctl.stats()
        assert (stats.admitted_now, stats.waiting_now, stats.reserved_blocks) == (0, 0, 0)

    run(scenario)


def test_cancelled_head_lets_the_next_waiter_through() -> None:
    async def scenario() -> None:
        ctl = controller(replace(THRESHOLDS, max_queue_wait_ms=5000.0))
        cluster = Cluster()
        await ctl.admit(make_request("a", prompt_tokens=11_800, uncached=0), cluster)
        big = asyncio.create_task(ctl.admit(make_request("big", prompt_tokens=3000), cluster))
        await settle()
        small = asyncio.create_task(ctl.admit(make_request("small", prompt_tokens=100), cluster))
        await settle()
        big.cancel()
        await settle()
        assert small.done() and small.result().request_id == "small"

    run(scenario)


def test_raising_thresholds_at_run_time_admits_queued_requests() -> None:
    async def scenario() -> None:
        ctl, cluster = controller(), Cluster()
        await ctl.admit(make_request("a"), cluster)
        waiting = asyncio.create_task(ctl.admit(make_request("b"), cluster))
        await settle()
        updated = ctl.set_thresholds(ctl.thresholds.with_changes(max_inflight_requests=2))
        assert updated.max_inflight_requests == 2 and ctl.thresholds == updated
        await settle()
        assert waiting.done() and waiting.result().request_id == "b"

    run(scenario)


def test_tightening_thresholds_rejects_queued_requests_that_can_no_longer_wait() -> None:
    async def scenario() -> None:
        ctl, cluster = controller(), Cluster()
        await ctl.admit(make_request("a"), cluster)
        waiting = asyncio.create_task(ctl.admit(make_request("b"), cluster))
        await settle()
        ctl.set_thresholds(replace(ONE_AT_A_TIME, max_queue_wait_ms=0.0))
        with pytest.raises(AdmissionRejected) as err:
            await waiting
        assert err.value.reason is Reason.INFLIGHT_LIMIT

    run(scenario)


def test_queued_requests_recheck_the_snapshot_while_prefill_queues_drain() -> None:
    async def scenario() -> None:
        ctl = controller(THRESHOLDS, recheck_interval_ms=10.0)
        cluster = Cluster(make_snapshot(prefills=(prefill(queued=10_000),)))  # TTFT over
        waiting = asyncio.create_task(ctl.admit(make_request("b"), cluster))
        await asyncio.sleep(0.03)
        assert not waiting.done()
        cluster.snapshot = make_snapshot()
        ticket = await asyncio.wait_for(waiting, 1.0)
        assert ticket.request_id == "b"
        assert cluster.calls >= 3

    run(scenario)


def test_failing_snapshot_provider_fails_only_its_own_request() -> None:
    async def scenario() -> None:
        ctl, cluster = controller(), Cluster()
        await ctl.admit(make_request("a"), cluster)

        def broken() -> ClusterSnapshot:
            if broken.armed:  # type: ignore[attr-defined]
                raise RuntimeError("load reports unavailable")
            return cluster()

        broken.armed = False  # type: ignore[attr-defined]
        waiting = asyncio.create_task(ctl.admit(make_request("b"), broken))
        await settle()
        broken.armed = True  # type: ignore[attr-defined]
        assert ctl.release("a") is True  # the provider's error does not escape release()
        with pytest.raises(RuntimeError, match="unavailable"):
            await waiting
        assert ctl.stats().waiting_now == 0

    run(scenario)


def test_duplicate_request_id_is_refused() -> None:
    async def scenario() -> None:
        ctl, cluster = controller(), Cluster()
        await ctl.admit(make_request("a"), cluster)
        with pytest.raises(DuplicateRequestId, match="'a'"):
            await ctl.admit(make_request("a"), cluster)
        waiting = asyncio.create_task(ctl.admit(make_request("b"), cluster))
        await settle()
        with pytest.raises(DuplicateRequestId):
            await ctl.admit(make_request("b"), cluster)
        waiting.cancel()
        await settle()

    run(scenario)


def test_release_is_idempotent() -> None:
    async def scenario() -> None:
        ctl = controller()
        assert ctl.release("nobody") is False
        await ctl.admit(make_request("a"), Cluster())
        assert ctl.release("a") is True
        assert ctl.release("a") is False
        assert ctl.stats().reserved_blocks == 0

    run(scenario)


def test_tenant_is_charged_on_admission_and_refunded_unused_tokens() -> None:
    async def scenario() -> None:
        limit = TenantLimit("acme", tokens_per_s=0.001, burst_tokens=2000.0)
        ctl = controller(THRESHOLDS, tenant_limits=(limit,))
        cluster = Cluster()
        ticket = await ctl.admit(make_request("a", tenant="acme"), cluster)
        assert ticket.charged_tokens == 1200
        with pytest.raises(AdmissionRejected) as err:
            await ctl.admit(make_request("b", tenant="acme"), cluster)
        assert err.value.reason is Reason.TENANT_RATE_LIMITED
        ctl.release("a", generated_tokens=10)  # 190 of 200 max_tokens unused
        allowance = ctl.limiter.allowance("acme")
        assert allowance is not None
        assert allowance.available_tokens == pytest.approx(990.0, abs=0.01)
        await ctl.admit(make_request("c", prompt_tokens=900, tenant="acme", max_tokens=1), cluster)
        await ctl.admit(make_request("d"), cluster)  # the default tenant is unlimited

    run(scenario)


def test_many_waiters_with_short_waits_all_finish_and_leave_no_state() -> None:
    async def scenario() -> None:
        ctl = controller(replace(ONE_AT_A_TIME, max_queue_wait_ms=30.0), recheck_interval_ms=5.0)
        cluster = Cluster()
        await ctl.admit(make_request("a"), cluster)
        results = await asyncio.gather(
            *(ctl.admit(make_request(f"r{i}", priority=i % 3), cluster) for i in range(50)),
            return_exceptions=True,
        )
        assert all(isinstance(r, AdmissionRejected) for r in results)
        stats = ctl.stats()
        assert (stats.waiting_now, stats.admitted_now, stats.reserved_blocks) == (0, 1, 75)
        assert stats.rejected_total == {Reason.QUEUE_TIMEOUT: 50}

    run(scenario)


def test_request_states_follow_the_documented_transitions() -> None:
    async def scenario() -> None:
        ctl = controller(replace(ONE_AT_A_TIME, max_queue_wait_ms=200.0))
        cluster = Cluster()
        assert ctl.state("a") is None
        await ctl.admit(make_request("a"), cluster)
        assert ctl.state("a") is RequestState.ADMITTED
        # QUEUED -> ADMITTED on release
        b = asyncio.create_task(ctl.admit(make_request("b"), cluster))
        await settle()
        assert ctl.state("b") is RequestState.QUEUED
        ctl.release("a")
        assert (ctl.state("a"), ctl.state("b")) == (None, RequestState.ADMITTED)
        await b
        # QUEUED -> gone on cancel
        c = asyncio.create_task(ctl.admit(make_request("c"), cluster))
        await settle()
        c.cancel()
        await settle()
        assert ctl.state("c") is None
        # QUEUED -> gone on timeout
        with pytest.raises(AdmissionRejected):
            await ctl.admit(make_request("d"), cluster)
        assert ctl.state("d") is None
        # QUEUED -> gone when re-evaluation rejects
        e = asyncio.create_task(ctl.admit(make_request("e"), cluster))
        await settle()
        ctl.set_thresholds(replace(ONE_AT_A_TIME, max_queue_wait_ms=0.0))
        with pytest.raises(AdmissionRejected):
            await e
        assert ctl.state("e") is None
        # ADMITTED -> gone on release
        ctl.release("b")
        assert ctl.state("b") is None

    run(scenario)


def test_tenant_over_its_inflight_limit_is_rejected_naming_it_while_others_are_admitted() -> None:
    async def scenario() -> None:
        limit = TenantLimit("acme", max_inflight_requests=2)
        ctl = controller(THRESHOLDS, tenant_limits=(limit,))
        cluster = Cluster()
        await ctl.admit(make_request("a1", tenant="acme"), cluster)
        await ctl.admit(make_request("a2", tenant="acme"), cluster)
        assert ctl.tenant_inflight("acme") == 2
        with pytest.raises(AdmissionRejected) as err:
            await ctl.admit(make_request("a3", tenant="acme"), cluster)
        assert err.value.reason is Reason.TENANT_INFLIGHT_LIMIT
        assert "max_inflight_requests 2" in err.value.message
        assert err.value.retry_after_ms == AdmissionConfig().tuning.default_retry_after_ms
        assert ctl.state("a3") is None  # rejected, not queued: it blocks nobody
        await ctl.admit(make_request("g1", tenant="globex"), cluster)  # another tenant goes
        ctl.release("a1")
        assert ctl.tenant_inflight("acme") == 1
        await ctl.admit(make_request("a4", tenant="acme"), cluster)
        for rid in ("a2", "a4", "g1"):
            ctl.release(rid)
        assert ctl.tenant_inflight("acme") == 0 and ctl.tenant_inflight("globex") == 0

    run(scenario)


def test_default_tenant_limit_applies_to_each_unlisted_tenant_alone() -> None:
    async def scenario() -> None:
        ctl = controller(THRESHOLDS, default_tenant_limit=TenantLimit("", max_inflight_requests=1))
        cluster = Cluster()
        await ctl.admit(make_request("x1", tenant="x"), cluster)
        await ctl.admit(make_request("y1", tenant="y"), cluster)
        with pytest.raises(AdmissionRejected) as err:
            await ctl.admit(make_request("x2", tenant="x"), cluster)
        assert err.value.reason is Reason.TENANT_INFLIGHT_LIMIT

    run(scenario)
