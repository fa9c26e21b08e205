"""Config, snapshot and request values: validation, the proto mirror, the rate limiter and the
prefill-throughput estimator."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
from admission_factories import decode, make_request, make_snapshot

from admission.config import (
    THRESHOLD_FIELDS,
    AdmissionConfig,
    AdmissionThresholds,
    InvalidAdmissionConfig,
    TenantLimit,
)
from admission.rate_limit import BucketState, TenantRateLimiter, charged, refilled
from admission.snapshot import PrefillWorkerLoad
from admission.throughput import PrefillThroughputEstimator


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- thresholds --------------------------------------------------------------------------------


def test_thresholds_mirror_the_admin_proto_message_field_by_field() -> None:
    from pdserve.v1 import serving_pb2

    proto_fields = [f.name for f in serving_pb2.AdmissionThresholds.DESCRIPTOR.fields]
    assert list(THRESHOLD_FIELDS) == proto_fields


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_estimated_ttft_ms", 0.0),
        ("max_queue_wait_ms", -1.0),
        ("max_inflight_requests", 0),
        ("max_decode_kv_utilization", 0.0),
        ("max_decode_kv_utilization", 1.01),
        ("local_prefill_threshold_tokens", -1),
    ],
)
def test_out_of_range_threshold_is_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(InvalidAdmissionConfig, match=f"^{field}: must be"):
        replace(AdmissionThresholds(), **{field: value})  # type: ignore[arg-type]


def test_with_changes_replaces_only_the_given_fields_zero_included() -> None:
    current = AdmissionThresholds(1000.0, 500.0, 100, 0.9, 32)
    changed = current.with_changes(max_queue_wait_ms=0.0, max_inflight_requests=7)
    assert changed == AdmissionThresholds(1000.0, 0.0, 7, 0.9, 32)
    assert current.with_changes() == current
    assert (
        current.with_changes(local_prefill_threshold_tokens=0).local_prefill_threshold_tokens == 0
    )


def test_with_changes_refuses_unknown_and_out_of_range_fields() -> None:
    current = AdmissionThresholds()
    with pytest.raises(InvalidAdmissionConfig, match="unknown threshold fields"):
        current.with_changes(max_tokens=3)
    with pytest.raises(InvalidAdmissionConfig, match=r"^max_decode_kv_utilization: must be"):
        current.with_changes(max_decode_kv_utilization=1.5)


def test_tenant_limits_must_be_unique() -> None:
    limit = TenantLimit("a", 10.0, 10.0)
    with pytest.raises(InvalidAdmissionConfig, match="tenant_limits"):
        AdmissionConfig(tenant_limits=(limit, limit))


# -- request and snapshot validation ------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"prompt_tokens": 0, "uncached": 0}, "prompt_tokens"),
        ({"uncached": 1001}, "uncached_prompt_tokens"),
        ({"uncached": -1}, "uncached_prompt_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"priority": 11}, "priority"),
        ({"priority": -11}, "priority"),
    ],
)
def test_invalid_request_is_refused_naming_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        make_request(**changes)


def test_invalid_worker_loads_are_refused() -> None:
    with pytest.raises(ValueError, match="throughput"):
        PrefillWorkerLoad("p", 0, 0.0)
    with pytest.raises(ValueError, match="queued_prefill_tokens"):
        PrefillWorkerLoad("p", -1, 1.0)
    with pytest.raises(ValueError, match="free_blocks"):
        decode(total=10, free=11)
    with pytest.raises(ValueError, match="reserved_blocks"):
        decode(reserved=-1)
    with pytest.raises(ValueError, match="block_size"):
        make_snapshot(block_size=0)
    with pytest.raises(ValueError, match="transfer_budget_blocks"):
        make_snapshot(transfer_budget=0)


def test_headroom_subtracts_used_and_reserved_blocks() -> None:
    worker = decode(total=1000, free=400, reserved=100)
    assert worker.headroom_blocks(0.9) == 900 - 600 - 100
    assert worker.headroom_blocks(1.0) == 300


def test_live_views_drop_dead_workers() -> None:
    snapshot = make_snapshot(decodes=(decode("a"), decode("b", live=False)))
    assert [w.worker_id for w in snapshot.live_decode] == ["a"]


def test_admission_imports_nothing_heavy() -> None:
    code = (
        "import sys, admission; "
        "heavy = {'torch', 'ray', 'grpc', 'redis', 'numpy', 'google.protobuf'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- token bucket ------------------------------------------------------------------------------


def level(limiter: TenantRateLimiter, tenant: str) -> float:
    allowance = limiter.allowance(tenant)
    assert allowance is not None
    return allowance.available_tokens


LIMIT = TenantLimit("acme", tokens_per_s=100.0, burst_tokens=1000.0)


def test_bucket_refills_at_the_rate_up_to_the_burst() -> None:
    state = BucketState(level=0.0, updated_at=10.0)
    assert refilled(state, LIMIT, 12.5) == BucketState(250.0, 12.5)
    assert refilled(state, LIMIT, 100.0) == BucketState(1000.0, 100.0)


def test_bucket_ignores_a_clock_that_goes_backwards() -> None:
    state = BucketState(level=10.0, updated_at=10.0)
    assert refilled(state, LIMIT, 9.0) == state


def test_charge_may_go_into_debt_and_refund_is_capped() -> None:
    state = BucketState(level=100.0, updated_at=0.0)
    assert charged(state, 300.0, LIMIT).level == -200.0
    assert charged(state, -5000.0, LIMIT).level == 1000.0


def test_limiter_charges_refills_and_refunds_per_tenant() -> None:
    clock = FakeClock()
    limiter = TenantRateLimiter([LIMIT], clock=clock)
    assert limiter.allowance("other") is None  # unlimited
    assert level(limiter, "acme") == 1000.0
    limiter.charge("acme", 1200.0)
    assert level(limiter, "acme") == -200.0
    clock.now += 3.0
    assert level(limiter, "acme") == pytest.approx(100.0)
    limiter.refund("acme", 50.0)
    assert level(limiter, "acme") == pytest.approx(150.0)
    limiter.charge("other", 10**9)  # no-op
    assert limiter.allowance("other") is None


def test_default_limit_gives_every_unlisted_tenant_its_own_bucket() -> None:
    clock = FakeClock()
    limiter = TenantRateLimiter(default=TenantLimit("*", 10.0, 100.0), clock=clock)
    limiter.charge("a", 100.0)
    assert level(limiter, "a") == 0.0
    assert level(limiter, "b") == 100.0


def test_full_buckets_are_forgotten() -> None:
    clock = FakeClock()
    limiter = TenantRateLimiter([LIMIT], clock=clock)
    limiter.charge("acme", 500.0)
    assert limiter.num_tracked_tenants == 1
    clock.now += 5.0
    assert level(limiter, "acme") == 1000.0
    assert limiter.num_tracked_tenants == 0


# -- prefill throughput ------------------------------------------------------------------------


def test_estimator_starts_at_the_prior() -> None:
    est = PrefillThroughputEstimator(prior_tokens_per_s=8000.0, alpha=0.2)
    assert est.tokens_per_s("p0") == 8000.0
    assert est.estimate("p0").samples == 0


def test_first_observations_are_averaged_with_the_prior_then_ewma() -> None:
    est = PrefillThroughputEstimator(prior_tokens_per_s=10_000.0, alpha=0.2)
    assert est.observe("p0", 2000, 1.0).tokens_per_s == pytest.approx(6000.0)  # weight 1/2
    assert est.observe("p0", 3000, 1.0).tokens_per_s == pytest.approx(5000.0)  # weight 1/3
    assert est.observe("p0", 1000, 1.0).tokens_per_s == pytest.approx(4000.0)  # weight 1/4
    assert est.observe("p0", 3400, 1.0).tokens_per_s == pytest.approx(3880.0)  # 1/5 = 0.2
    assert est.observe("p0", 880, 1.0).tokens_per_s == pytest.approx(3280.0)  # alpha 0.2
    assert est.estimate("p0").samples == 5


def test_estimator_converges_to_a_steady_rate() -> None:
    est = PrefillThroughputEstimator(prior_tokens_per_s=50_000.0, alpha=0.2)
    for _ in range(60):
        est.observe("p0", 512, 0.128)  # 4000 tok/s
    assert est.tokens_per_s("p0") == pytest.approx(4000.0, rel=1e-4)


def test_estimator_ignores_empty_samples_and_keeps_workers_apart() -> None:
    est = PrefillThroughputEstimator(prior_tokens_per_s=1000.0)
    est.observe("p0", 0, 1.0)
    est.observe("p0", 100, 0.0)
    assert est.estimate("p0").samples == 0
    est.observe("p1", 3000, 1.0)
    assert est.tokens_per_s("p0") == 1000.0
    assert est.tokens_per_s("p1") == pytest.approx(2000.0)
    est.forget("p1")
    assert est.tokens_per_s("p1") == 1000.0


def test_estimator_refuses_bad_parameters() -> None:
    with pytest.raises(ValueError, match="prior"):
        PrefillThroughputEstimator(prior_tokens_per_s=0.0)
    with pytest.raises(ValueError, match="alpha"):
        PrefillThroughputEstimator(alpha=0.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tokens_per_s=1.0), "burst_tokens: must be set with tokens_per_s"),
        (dict(burst_tokens=1.0), "tokens_per_s: must be set with burst_tokens"),
        (dict(), "tokens_per_s: set a rate"),
        (dict(max_inflight_requests=0), "max_inflight_requests: must be >= 1"),
        (dict(tokens_per_s=0.0, burst_tokens=1.0), "tokens_per_s: must be > 0"),
    ],
)
def test_a_tenant_limit_needs_a_whole_rate_or_an_inflight_limit(
    kwargs: dict[str, float], message: str
) -> None:
    with pytest.raises(InvalidAdmissionConfig) as err:
        TenantLimit("t", **kwargs)  # type: ignore[arg-type]
    assert str(err.value).startswith(message)
