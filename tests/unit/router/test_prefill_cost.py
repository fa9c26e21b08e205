"""The `cost` local-prefill policy: exact predictions on a hand-made model (prefill 10 ms + 1 ms
per token, a decode step 10 ms, a hand-off 50 ms + 1 ms per block), each term moving the
choice the way it should, the threshold as the fallback, and bad values refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.placement import (
    DecodeCandidate,
    PlacementConfig,
    PrefillCandidate,
    PrefillReason,
    place,
)
from router.prefill_cost import (
    LocalPrefillConfig,
    LocalPrefillPolicy,
    PrefillCostModel,
    PrefillLoad,
    estimate,
)

BS = 16
MODEL = PrefillCostModel(
    source="hand-made",
    token_budget=2048,
    prefill_tokens=(1, 100, 200),
    prefill_s=(0.011, 0.11, 0.21),
    prefill_s_per_cached_token=0.0,
    decode_contexts=(100,),
    decode_batches=((1, 8),),
    decode_s=((0.01, 0.01),),
    handoff_fixed_s=0.05,
    handoff_per_block_s=0.001,
)


def load(running: int = 1, **changes: int) -> PrefillLoad:
    base = PrefillLoad(
        decode_cached_blocks=0,
        decode_queued_prefill_tokens=0,
        decode_running=running,
        decode_kv_blocks=10 * running,
        decode_transfer_blocks=0,
        prefill_cached_blocks=0,
        prefill_queued_tokens=0,
    )
    return replace(base, **changes)


def test_an_idle_decode_worker_prefills_itself_and_saves_the_handoff() -> None:
    e = estimate(MODEL, 64, BS, load(running=0))
    assert (e.local_wait_s, e.stall_s, e.stalled_streams) == pytest.approx((0.074, 0.074, 0))
    assert (e.remote_wait_s, e.handoff_s) == pytest.approx((0.074, 0.054))  # 4 blocks pulled
    assert e.local


def test_more_streams_to_stall_send_the_prompt_to_the_prefill_worker() -> None:
    # local: 26 ms + a 10 ms decode step + N * 26 ms; remote: 26 ms + a 51 ms hand-off
    one = estimate(MODEL, 16, BS, load(running=1))
    assert (one.local_s, one.remote_s) == pytest.approx((0.062, 0.077))
    assert one.local
    two = estimate(MODEL, 16, BS, load(running=2))
    assert two.local_s == pytest.approx(0.088)
    assert not two.local


def test_more_uncached_tokens_send_the_prompt_to_the_prefill_worker() -> None:
    assert estimate(MODEL, 16, BS, load()).local  # 62 ms against 77 ms
    tie = estimate(MODEL, 32, BS, load())  # 42 + 10 + 42 against 42 + 52: a tie goes remote
    assert tie.local_s == pytest.approx(tie.remote_s) and not tie.local
    assert not estimate(MODEL, 64, BS, load()).local  # 158 ms against 128 ms


def test_a_prefix_the_decode_worker_holds_shortens_its_prefill() -> None:
    e = estimate(MODEL, 64, BS, load(decode_cached_blocks=3))  # 16 tokens left to compute
    assert (e.local_wait_s, e.stall_s) == pytest.approx((0.036, 0.026))
    assert e.handoff_s == pytest.approx(0.051)  # it would pull the one block it lacks
    assert e.local


def test_a_queue_on_the_prefill_worker_keeps_the_prompt_local() -> None:
    assert not estimate(MODEL, 64, BS, load()).local
    e = estimate(MODEL, 64, BS, load(prefill_queued_tokens=100))
    assert e.remote_wait_s == pytest.approx(0.174)  # 164 tokens in one step
    assert e.local


def test_a_slow_handoff_keeps_the_prompt_local() -> None:
    e = estimate(MODEL, 64, BS, load(decode_transfer_blocks=100))  # behind 100 blocks
    assert e.handoff_s == pytest.approx(0.05 + 0.104)
    assert e.local


def test_prefills_queued_on_the_decode_worker_make_a_local_one_wait() -> None:
    e = estimate(MODEL, 16, BS, load(decode_queued_prefill_tokens=100))
    # 116 tokens in one step: 126 ms, of which this prompt adds 16 ms to the stalled streams
    assert (e.local_wait_s, e.stall_s) == pytest.approx((0.136, 0.016))
    assert not e.local


def test_the_stall_weight_scales_what_the_running_streams_count() -> None:
    assert estimate(MODEL, 16, BS, load(), stall_weight=1.0).local
    assert not estimate(MODEL, 16, BS, load(), stall_weight=4.0).local


def test_a_long_prompt_is_chunked_at_the_token_budget() -> None:
    small = replace(MODEL, token_budget=100)
    assert small.prefill_seconds(250) == pytest.approx(0.11 + 0.11 + 0.06)
    assert small.prefill_seconds(0) == 0.0
    cached = replace(small, prefill_s_per_cached_token=0.0001)
    # each chunk attends to the cached prefix and to the chunks before it
    assert cached.prefill_seconds(150, cached=50) == pytest.approx(0.11 + 0.005 + 0.06 + 0.015)


# ---- through placement ----------------------------------------------------------------------


def pre(queued: int = 0) -> PrefillCandidate:
    return PrefillCandidate("p0", cached_blocks=0, queued_prefill_tokens=queued)


def dec(running: int = 1, transfer: int = 0) -> DecodeCandidate:
    return DecodeCandidate(
        "d0", 0, 10 * running, transfer, 1000, running_requests=running
    )  # fmt: skip


COST = PlacementConfig(local_prefill_policy=LocalPrefillPolicy.COST, prefill_cost=MODEL)


def test_placement_under_the_cost_policy_says_why_and_carries_the_prediction() -> None:
    local = place(16, BS, [pre()], [dec()], COST)
    assert (local.local_prefill, local.reason) == (True, PrefillReason.LOCAL_CHEAPER)
    assert local.estimate == estimate(MODEL, 16, BS, load())
    remote = place(16, BS, [pre()], [dec(running=4)], COST)
    assert (remote.prefill_worker_id, remote.reason) == ("p0", PrefillReason.REMOTE_CHEAPER)
    assert remote.estimate is not None and not remote.estimate.local
    # the threshold does not bind the cost policy: 640 uncached tokens, prefill worker backed up
    busy = place(640, BS, [pre(queued=4000)], [dec(running=0)], COST)
    assert busy.local_prefill and busy.uncached_tokens == 640


def test_without_a_profile_the_cost_policy_is_the_threshold() -> None:
    fallback = PlacementConfig(
        local_prefill_threshold_tokens=32, local_prefill_policy=LocalPrefillPolicy.COST
    )
    short = place(32, BS, [pre()], [dec(running=8)], fallback)
    assert (short.local_prefill, short.reason, short.estimate) == (
        True, PrefillReason.UNDER_THRESHOLD, None,
    )  # fmt: skip
    long = place(33, BS, [pre(queued=10_000)], [dec(running=0)], fallback)
    assert (long.prefill_worker_id, long.reason) == ("p0", PrefillReason.OVER_THRESHOLD)
    # a profile given to the threshold policy is not used either
    threshold = replace(fallback, local_prefill_policy=LocalPrefillPolicy.THRESHOLD)
    assert replace(threshold, prefill_cost=MODEL).cost_model is None


def test_after_the_first_token_only_a_missing_prefill_worker_makes_it_local() -> None:
    retry = replace(COST, allow_local=False)
    p = place(16, BS, [pre()], [dec(running=0)], retry)  # the cost model would say local
    assert (p.prefill_worker_id, p.reason, p.estimate) == (
        "p0",
        PrefillReason.FIRST_TOKEN_OUT,
        None,
    )
    alone = place(16, BS, [], [dec()], retry)
    assert (alone.local_prefill, alone.reason) == (True, PrefillReason.NO_PREFILL_WORKER)


def test_a_split_worker_prefills_itself_unless_a_prefill_worker_caches_more() -> None:
    split = DecodeCandidate("s0", 2, 0, 0, 1000, prefills_locally=True, running_requests=8)
    for config in (COST, PlacementConfig()):
        p = place(640, BS, [pre()], [split], config)
        assert (p.local_prefill, p.reason, p.cached_blocks) == (
            True, PrefillReason.SPLIT_WORKER, 2,
        )  # fmt: skip
        warm = PrefillCandidate("p1", cached_blocks=30, queued_prefill_tokens=0)
        p = place(640, BS, [pre(), warm], [split], config)
        assert (p.prefill_worker_id, p.reason) == ("p1", PrefillReason.LONGER_PREFIX)


def test_every_reason_names_its_side() -> None:
    local = {r for r in PrefillReason if r.local}
    assert local == {
        PrefillReason.NO_PREFILL_WORKER, PrefillReason.UNDER_THRESHOLD,
        PrefillReason.LOCAL_CHEAPER, PrefillReason.SPLIT_WORKER,
    }  # fmt: skip


# ---- bad values -----------------------------------------------------------------------------


def test_bad_settings_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^policy: one of threshold, cost, got 'fast'"):
        LocalPrefillConfig(policy="fast")
    with pytest.raises(ValueError, match=r"^stall_weight: must be >= 0, got -1"):
        LocalPrefillConfig(stall_weight=-1.0)
    with pytest.raises(ValueError, match=r"^stall_weight: must be >= 0, got nan"):
        LocalPrefillConfig(stall_weight=float("nan"))
    assert LocalPrefillConfig(policy="cost").kind is LocalPrefillPolicy.COST


def test_a_malformed_cost_model_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^prefill_s: one time per point"):
        replace(MODEL, prefill_s=(0.01,))
    with pytest.raises(ValueError, match=r"^decode_s: one time per batch size"):
        replace(MODEL, decode_s=((0.01,),))
    with pytest.raises(ValueError, match=r"^decode_batches: one row per point"):
        replace(MODEL, decode_contexts=(100, 200))
    with pytest.raises(ValueError, match=r"^token_budget: must be >= 1, got 0"):
        replace(MODEL, token_budget=0)
    with pytest.raises(ValueError, match=r"^handoff_fixed_s: "):
        replace(MODEL, handoff_per_block_s=-0.001)
