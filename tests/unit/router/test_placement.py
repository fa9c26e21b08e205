"""Placement cost function: exact choices on hand-made candidates."""

from __future__ import annotations

import pytest

from router.placement import (
    DecodeCandidate,
    NoWorkerError,
    PlacementConfig,
    PrefillCandidate,
    place,
)

BS = 16


def pre(wid: str, cached: int = 0, queued: int = 0) -> PrefillCandidate:
    return PrefillCandidate(wid, cached_blocks=cached, queued_prefill_tokens=queued)


def dec(
    wid: str, cached: int = 0, active: int = 0, inflight: int = 0, free: int = 1000
) -> DecodeCandidate:
    return DecodeCandidate(wid, cached, active, inflight, free)


def test_prefill_goes_to_worker_holding_the_prefix() -> None:
    p = place(640, BS, [pre("p0"), pre("p1", cached=30)], [dec("d0")], PlacementConfig())
    assert (p.prefill_worker_id, p.cached_blocks, p.uncached_tokens) == ("p1", 30, 160)


def test_prefix_holder_loses_when_its_queue_outweighs_the_saving() -> None:
    # p1 saves 30 blocks * w=4 = 120; its queue costs 3000/16 = 187.5 > 120
    p = place(
        640, BS, [pre("p0"), pre("p1", cached=30, queued=3000)], [dec("d0")], PlacementConfig()
    )
    assert p.prefill_worker_id == "p0"


def test_decode_least_loaded_counts_inflight_transfers() -> None:
    p = place(
        64,
        BS,
        [pre("p0")],
        [dec("d0", active=10, inflight=20), dec("d1", active=25)],
        PlacementConfig(),
    )
    assert p.decode_worker_id == "d1"


def test_decode_tie_prefers_cached_prefix_then_id() -> None:
    assert (
        place(64, BS, [pre("p")], [dec("d1"), dec("d0")], PlacementConfig()).decode_worker_id
        == "d0"
    )
    got = place(64, BS, [pre("p")], [dec("d0"), dec("d1", cached=2)], PlacementConfig())
    assert got.decode_worker_id == "d1"


def test_short_uncached_prompt_prefills_locally_on_decode() -> None:
    cfg = PlacementConfig(local_prefill_threshold_tokens=32)
    p = place(100, BS, [pre("p0")], [dec("d0", cached=5)], cfg)  # 100 - 80 = 20 <= 32
    assert p.local_prefill and (p.cached_blocks, p.uncached_tokens) == (5, 20)
    p = place(100, BS, [pre("p0")], [dec("d0", cached=2)], cfg)  # 100 - 32 = 68 > 32
    assert p.prefill_worker_id == "p0"


def test_no_prefill_worker_falls_back_to_local_prefill() -> None:
    p = place(1000, BS, [], [dec("d0")], PlacementConfig())
    assert p.local_prefill and p.uncached_tokens == 1000


def test_no_decode_worker_is_unavailable() -> None:
    with pytest.raises(NoWorkerError, match="no live decode worker"):
        place(10, BS, [pre("p0")], [], PlacementConfig())


def test_full_decode_workers_are_avoided_when_another_has_room() -> None:
    p = place(
        64,
        BS,
        [pre("p")],
        [dec("d0", free=2), dec("d1", active=50, free=40)],
        PlacementConfig(),
        needed_decode_blocks=10,
    )
    assert p.decode_worker_id == "d1"


def test_cached_blocks_capped_at_full_prompt_blocks() -> None:
    # index may report more blocks than this prompt has (another request's longer prompt)
    p = place(40, BS, [pre("p0", cached=9)], [dec("d0")], PlacementConfig())
    assert (p.cached_blocks, p.uncached_tokens) == (2, 8)


def test_host_tier_holder_beats_a_cold_worker_and_loses_to_a_device_holder() -> None:
    host = PrefillCandidate("p-host", cached_blocks=30, queued_prefill_tokens=0, host_blocks=30)
    device = PrefillCandidate("p-dev", cached_blocks=30, queued_prefill_tokens=0)
    cold = pre("p-cold")
    cfg = PlacementConfig()
    assert place(640, BS, [cold, host], [dec("d0")], cfg).prefill_worker_id == "p-host"
    assert place(640, BS, [cold, host, device], [dec("d0")], cfg).prefill_worker_id == "p-dev"
    # onboarding 30 blocks (30 * 0.25 = 7.5) is worth less than a queue of 16 blocks of work
    busy_device = PrefillCandidate("p-dev", 30, queued_prefill_tokens=16 * 16)
    assert place(640, BS, [host, busy_device], [dec("d0")], cfg).prefill_worker_id == "p-host"


def test_a_worker_that_holds_the_adapter_beats_one_that_must_read_it() -> None:
    warm = PrefillCandidate("p-warm", 0, queued_prefill_tokens=0)
    cold = PrefillCandidate("p-cold", 0, queued_prefill_tokens=0, cold_lora=True)
    cfg = PlacementConfig(cold_lora_weight=16.0)
    # "p-cold" sorts first by id: only the adapter cost puts "p-warm" ahead
    assert place(640, BS, [cold, warm], [dec("d0")], cfg).prefill_worker_id == "p-warm"
    # a queue of more than 16 blocks of work outweighs the read
    busy = PrefillCandidate("p-warm", 0, queued_prefill_tokens=17 * BS)
    assert place(640, BS, [cold, busy], [dec("d0")], cfg).prefill_worker_id == "p-cold"
    d_cold = DecodeCandidate("d-a", 0, 0, 0, 1000, cold_lora=True)
    d_warm = DecodeCandidate("d-b", 0, 10, 0, 1000)
    assert place(640, BS, [warm], [d_cold, d_warm], cfg).decode_worker_id == "d-b"
    assert place(640, BS, [warm], [d_cold, d_warm], PlacementConfig()).decode_worker_id == "d-b"
    no_weight = PlacementConfig(cold_lora_weight=0.0)
    assert place(640, BS, [warm], [d_cold, d_warm], no_weight).decode_worker_id == "d-a"
