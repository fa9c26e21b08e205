"""Two real processes moving KV blocks with NIXL over UCX (shm/tcp on loopback, CPU only).

The test process holds one endpoint; a spawned peer process holds the other (kvt_peer.py).
Every wait has a deadline; each test also has a hard pytest timeout.
"""

from __future__ import annotations

import dataclasses
import queue
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from kvt_peer import (
    HOST_BLOCKS,
    LARGE,
    LAYERED,
    MODEL,
    SMALL,
    Peer,
    Released,
    backend_factory,
    decode_main,
    fill,
)
from kvt_peer import prefill_main as prefill_peer_main

from engine.kv.kv_cache import LAYER_MAJOR, KVCache, KVCacheSpec
from kv_transfer.config import BudgetConfig, DescriptorMode, KVTransferConfig
from kv_transfer.decode_endpoint import DecodeEndpoint
from kv_transfer.manager import TransferOutcome, TransferState
from kv_transfer.nixl_backend import NixlBackend
from kv_transfer.prefill_endpoint import PrefillEndpoint
from kv_transfer.protocol import HandshakeInfo
from kv_transfer.types import DescriptorRun, SliceRead, TransferPlan
from vocabulary.kv_events import KVTier
from vocabulary.kv_handle import KVHandle
from vocabulary.transfer_errors import (
    BackendError,
    HandshakeError,
    PeerLost,
    TransferError,
    TransferTimeout,
)

pytestmark = pytest.mark.timeout(240)  # generous: other jobs may load the 2-core machine

PREFILL_CONFIG = KVTransferConfig(reaper_interval_s=0.05, lease_s=10.0)
DECODE_CONFIG = KVTransferConfig(capture_telemetry=True, idle_tick_s=0.02)


def blocks_of(cache: KVCache, block_ids: list[int]) -> torch.Tensor:
    """Whole blocks (every layer of each) as [len(block_ids), ...], in any layout."""
    return cache.tensor.movedim(cache.spec.block_dim, 0)[block_ids]


def expected_blocks(spec: KVCacheSpec, block_ids: list[int], seed: int = 1) -> torch.Tensor:
    """The peer's pool blocks (seed 1), or its host tier's (seed 2)."""
    cache = KVCache(dataclasses.replace(spec, num_blocks=max(block_ids) + 1))
    fill(cache, seed=seed)
    return blocks_of(cache, block_ids)


class Decoder:
    """A decode endpoint in the test process, collecting outcomes."""

    def __init__(
        self, spec: KVCacheSpec, config: KVTransferConfig = DECODE_CONFIG, fault: str = "nixl"
    ) -> None:
        self.cache = KVCache(spec)
        self.outcomes: queue.Queue[TransferOutcome] = queue.Queue()
        self.endpoint = DecodeEndpoint(
            self.cache,
            MODEL,
            "d0",
            self.outcomes.put,
            self.outcomes.put,
            config,
            backend_factory(fault),
        )
        self.endpoint.start()

    def wait(self, n: int, timeout_s: float) -> list[TransferOutcome]:
        deadline = time.monotonic() + timeout_s
        got: list[TransferOutcome] = []
        while len(got) < n:
            got.append(self.outcomes.get(timeout=max(0.0, deadline - time.monotonic())))
        return got


def wait_for(cond: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


DOOMED_DECODE_CONFIG = KVTransferConfig(
    budget=BudgetConfig(max_inflight_blocks=16),
    heartbeat_interval_s=0.2,
    lease_extension_s=1.0,
    lease_safety_margin_s=0.1,
)


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, Peer]]:
    """Every peer process of the module, spawned at once so their start-ups overlap."""
    started = {
        "prefill": Peer(prefill_peer_main, SMALL, PREFILL_CONFIG),  # shared, never killed
        "layered_prefill": Peer(prefill_peer_main, LAYERED, PREFILL_CONFIG),  # likewise
        "doomed_prefill": Peer(prefill_peer_main, LARGE, PREFILL_CONFIG),
        "doomed_decode": Peer(decode_main, LARGE, DOOMED_DECODE_CONFIG),
    }
    try:
        yield started
    finally:
        for peer in started.values():
            peer.stop()


@pytest.fixture(scope="module")
def prefill(peers: dict[str, Peer]) -> tuple[Peer, HandshakeInfo]:
    """The shared prefill process (SMALL pool, block b filled from seed 1) and its handshake."""
    peer = peers["prefill"]
    return peer, peer.recv(timeout_s=150)


@pytest.fixture(scope="module")
def layered_prefill(peers: dict[str, Peer]) -> tuple[Peer, HandshakeInfo]:
    """The shared prefill process over a layer-major pool (LAYERED, with a host tier)."""
    peer = peers["layered_prefill"]
    return peer, peer.recv(timeout_s=150)


@pytest.fixture()
def decoder() -> Iterator[Callable[..., Decoder]]:
    made: list[Decoder] = []

    def make(*args: object, **kwargs: object) -> Decoder:
        d = Decoder(*args, **kwargs)  # type: ignore[arg-type]
        made.append(d)
        return d

    yield make
    for d in made:
        d.endpoint.close()


def released_ids(peer: Peer) -> dict[str, Released]:
    return {r.request_id: r for r in peer.ask("released")}


def test_two_processes_pull_blocks_over_nixl_and_bytes_match(
    prefill: tuple[Peer, HandshakeInfo], decoder: Callable[..., Decoder]
) -> None:
    peer, info = prefill
    d = decoder(SMALL)
    d.endpoint.add_peer(info)
    contiguous: KVHandle = peer.ask("hand_off", "contig", [10, 11, 12, 13], None)
    scattered: KVHandle = peer.ask("hand_off", "scatter", [40, 3, 4, 20], None)
    reused: KVHandle = peer.ask("hand_off", "reuse", [30, 31, 32], None)
    plans = [
        d.endpoint.submit(contiguous, [0, 1, 2, 3]),
        d.endpoint.submit(scattered, [8, 9, 10, 50]),
        d.endpoint.submit(reused, [20, 21], num_reused=1),  # block 30 is already here
    ]
    assert [p.num_descriptors for p in plans] == [1, 3, 1]
    outcomes = {o.request_id: o for o in d.wait(3, timeout_s=20)}
    assert {o.state for o in outcomes.values()} == {TransferState.DONE}
    for plan in plans:
        got = d.cache.tensor[list(plan.local_block_ids)]
        assert torch.equal(got, expected_blocks(SMALL, list(plan.remote_block_ids)))
        assert outcomes[plan.request_id].posted_descriptors == plan.num_descriptors
    untouched = sorted(set(range(SMALL.num_blocks)) - {b for p in plans for b in p.local_block_ids})
    assert d.cache.tensor[untouched].abs().sum() == 0  # nothing else was written
    wait_for(lambda: {"contig", "scatter", "reuse"} <= set(released_ids(peer)), timeout_s=5)
    stats = d.endpoint.stats()
    assert (stats.transfers_done, stats.blocks_transferred, stats.descriptors) == (3, 10, 5)


def test_blocks_in_the_prefill_host_tier_are_read_from_its_registered_host_memory(
    prefill: tuple[Peer, HandshakeInfo], decoder: Callable[..., Decoder]
) -> None:
    peer, info = prefill
    assert [(r.tier, r.mem_type, r.num_blocks) for r in info.tier_regions] == [
        (KVTier.HOST, "DRAM", HOST_BLOCKS)
    ]
    d = decoder(SMALL)
    d.endpoint.add_peer(info)
    host, dev = KVTier.HOST, KVTier.DEVICE
    # a prefix lent from the host tier (slots 6, 7, 8), the rest from the pool (blocks 6, 7)
    handle: KVHandle = peer.ask("hand_off", "tiers", [6, 7, 8, 6, 7], None,
                                [host, host, host, dev, dev])  # fmt: skip
    plan = d.endpoint.submit(handle, [0, 1, 2, 3, 4])
    assert plan.num_descriptors == 2  # one run per region, however adjacent the ids
    [outcome] = d.wait(1, timeout_s=20)
    assert outcome.state is TransferState.DONE, outcome.error
    assert outcome.posted_descriptors == 2
    assert torch.equal(d.cache.tensor[[0, 1, 2]], expected_blocks(SMALL, [6, 7, 8], seed=2))
    assert torch.equal(d.cache.tensor[[3, 4]], expected_blocks(SMALL, [6, 7]))
    wait_for(lambda: "tiers" in released_ids(peer), timeout_s=5)  # once both reads are done


@pytest.mark.parametrize("mode", [DescriptorMode.PREPPED, DescriptorMode.COALESCED])
def test_layer_major_pools_pull_every_layer_of_each_block_from_pool_and_host_tier(
    layered_prefill: tuple[Peer, HandshakeInfo],
    decoder: Callable[..., Decoder],
    mode: DescriptorMode,
) -> None:
    """A layer-major block is a segment per layer, each in its layer's page array, so a read
    posts one descriptor per (layer, run); the decode pool is smaller than the peer's, so the
    two sides' segments lie at different strides."""
    peer, info = layered_prefill
    layers = LAYERED.num_layers
    assert [(r.tier, r.num_segments) for r in (info.region, *info.tier_regions)] == [
        (KVTier.DEVICE, layers), (KVTier.HOST, layers)
    ]  # fmt: skip
    local_spec = dataclasses.replace(LAYERED, num_blocks=48)
    d = decoder(local_spec, dataclasses.replace(DECODE_CONFIG, descriptor_mode=mode))
    d.endpoint.add_peer(info)
    host, dev = KVTier.HOST, KVTier.DEVICE
    rid = f"layers-{mode.value}"
    contiguous: KVHandle = peer.ask("hand_off", f"{rid}-run", [10, 11, 12, 13], None)
    # the peer's last block, a run of two and a scattered one into the local pool's last block
    scattered: KVHandle = peer.ask("hand_off", f"{rid}-scatter", [63, 3, 4, 20], None)
    tiered: KVHandle = peer.ask("hand_off", f"{rid}-tiers", [6, 7, 8, 30], None,
                                [host, host, host, dev])  # fmt: skip
    plans = [
        d.endpoint.submit(contiguous, [0, 1, 2, 3]),
        d.endpoint.submit(scattered, [8, 9, 10, 47]),
        d.endpoint.submit(tiered, [20, 21, 22, 23]),
    ]
    assert [p.num_descriptors for p in plans] == [layers * 1, layers * 3, layers * 2]
    outcomes = {o.request_id: o for o in d.wait(3, timeout_s=20)}
    assert {o.state for o in outcomes.values()} == {TransferState.DONE}, outcomes
    for plan in plans[:2]:
        want = expected_blocks(LAYERED, list(plan.remote_block_ids))
        assert torch.equal(blocks_of(d.cache, list(plan.local_block_ids)), want)
    assert torch.equal(blocks_of(d.cache, [20, 21, 22]), expected_blocks(LAYERED, [6, 7, 8], 2))
    assert torch.equal(blocks_of(d.cache, [23]), expected_blocks(LAYERED, [30]))
    for plan in plans:
        assert outcomes[plan.request_id].posted_descriptors == plan.num_descriptors
    written = {b for p in plans for b in p.local_block_ids}
    untouched = [b for b in range(local_spec.num_blocks) if b not in written]
    assert not blocks_of(d.cache, untouched).any()  # nothing else, in no layer
    done = {p.request_id for p in plans}
    wait_for(lambda: done <= set(released_ids(peer)), timeout_s=5)


def test_a_head_slice_of_a_layer_major_pool_is_refused(
    layered_prefill: tuple[Peer, HandshakeInfo],
) -> None:
    """A byte range of a block is one region only in a block-first pool: the backend refuses
    a partial `SliceRead` over layer-major regions instead of reading the wrong bytes."""
    _, info = layered_prefill
    backend = NixlBackend("slice-refuser", KVCache(LAYERED))
    try:
        backend.add_peer(info.agent_name, info.agent_metadata, info.region)
        half = LAYERED.head_nbytes  # one of the pool's two KV heads
        plan = TransferPlan(
            request_id="slice", peer=info.agent_name, remote_block_ids=(1,),
            local_block_ids=(2,), num_reused=0, runs=(DescriptorRun(1, 2, 1),),
            block_nbytes=LAYERED.block_nbytes, num_segments=LAYERED.num_layers,
            slices=(SliceRead(0, info.agent_name, half, 0, half, whole=False),),
        )  # fmt: skip
        with pytest.raises(BackendError, match="device region has 3 segments a block"):
            backend.start_read(plan, b"")
    finally:
        backend.close()


def test_incompatible_peer_is_refused_with_a_clear_error(
    prefill: tuple[Peer, HandshakeInfo], decoder: Callable[..., Decoder]
) -> None:
    _, info = prefill
    d = decoder(dataclasses.replace(SMALL, block_size=32))
    with pytest.raises(HandshakeError, match="block_size: peer 16 vs local 32"):
        d.endpoint.add_peer(info)
    layered = decoder(dataclasses.replace(SMALL, layout=LAYER_MAJOR))
    with pytest.raises(HandshakeError) as err:
        layered.endpoint.add_peer(info)
    assert "block_major_v1 → decode TP=1 over 2 KV heads, layer_major_v1" in str(err.value)
    assert "the KV layouts differ" in str(err.value)
    same = decoder(SMALL)
    with pytest.raises(HandshakeError, match="protocol v2"):
        same.endpoint.add_peer(dataclasses.replace(info, protocol_version=2))
    assert not same.endpoint.has_peer(info.agent_name)


def test_dropped_completion_notice_lease_expiry_frees_prefill_blocks(
    prefill: tuple[Peer, HandshakeInfo], decoder: Callable[..., Decoder]
) -> None:
    peer, info = prefill
    d = decoder(SMALL, fault="drop")
    d.endpoint.add_peer(info)
    handle: KVHandle = peer.ask("hand_off", "dropped", [5, 6], 1.0)
    d.endpoint.submit(handle, [0, 1])
    (outcome,) = d.wait(1, timeout_s=5)
    assert outcome.state is TransferState.DONE
    assert torch.equal(d.cache.tensor[[0, 1]], expected_blocks(SMALL, [5, 6]))
    wait_for(lambda: "dropped" in released_ids(peer), timeout_s=5)
    freed = released_ids(peer)["dropped"]
    assert freed.block_ids == (5, 6)
    assert handle.lease_deadline <= freed.at < handle.lease_deadline + 1.0  # reaper, on time
    stats, pinned = peer.ask("stats")
    assert stats.expired >= 1 and not ({5, 6} & pinned)


def test_lost_read_completion_times_out_and_both_sides_free_their_blocks(
    prefill: tuple[Peer, HandshakeInfo], decoder: Callable[..., Decoder]
) -> None:
    peer, info = prefill
    d = decoder(SMALL, fault="lost")
    d.endpoint.add_peer(info)
    handle: KVHandle = peer.ask("hand_off", "lost", [7, 8], None)  # 10 s lease
    start = time.time()
    d.endpoint.submit(handle, [30, 31], deadline=start + 0.5)
    (outcome,) = d.wait(1, timeout_s=5)
    assert outcome.state is TransferState.EXPIRED and isinstance(outcome.error, TransferTimeout)
    assert outcome.plan.local_block_ids == (30, 31)
    assert time.time() - start < 0.5 + 1.0
    # decode's abort notice ends the prefill lease long before its 10 s deadline
    wait_for(lambda: "lost" in released_ids(peer), timeout_s=2)
    assert released_ids(peer)["lost"].at < handle.lease_deadline - 8
    # the load snapshot is published at the end of the endpoint tick that delivered the outcome
    wait_for(lambda: d.endpoint.load().in_flight_blocks == 0, timeout_s=1)


def test_killed_prefill_mid_pull_decode_frees_every_block_within_its_deadline(
    peers: dict[str, Peer], decoder: Callable[..., Decoder]
) -> None:
    peer = peers["doomed_prefill"]
    try:
        info = peer.recv(timeout_s=150)
        config = KVTransferConfig(budget=BudgetConfig(max_inflight_blocks=16), idle_tick_s=0.02)
        d = decoder(LARGE, config, fault="slow")
        d.endpoint.add_peer(info)
        handles = [
            peer.ask("hand_off", f"r{i}", list(range(16 * i, 16 * i + 16)), None) for i in range(12)
        ]
        deadline = time.time() + 5.0
        plans = [
            d.endpoint.submit(h, list(range(16 * i, 16 * i + 16)), deadline=deadline)
            for i, h in enumerate(handles)
        ]
        first = d.wait(1, timeout_s=20)
        peer.kill()
        killed_at = time.time()
        rest = d.wait(len(handles) - 1, timeout_s=deadline - time.time() + 1.0)
    finally:
        peer.kill()
    outcomes = first + rest
    assert time.time() <= deadline + 1.0
    failed = [o for o in outcomes if o.state is not TransferState.DONE]
    assert failed, "the kill landed after every pull finished"
    assert all(isinstance(o.error, (PeerLost, TransferError)) for o in failed)
    freed = sorted(b for o in failed for b in o.plan.local_block_ids)
    done = sorted(
        b for o in outcomes if o.state is TransferState.DONE for b in o.plan.local_block_ids
    )
    assert sorted(freed + done) == sorted(b for p in plans for b in p.local_block_ids)
    wait_for(lambda: d.endpoint.load().pending_blocks == 0, timeout_s=1)
    print(
        f"killed prefill: {len(failed)} of {len(outcomes)} pulls failed, last outcome "
        f"{max(time.time() - killed_at, 0):.2f}s after the kill"
    )


def test_killed_decode_mid_pull_prefill_frees_every_lease_in_time(
    peers: dict[str, Peer],
) -> None:
    released: queue.Queue[tuple[str, tuple[int, ...], float]] = queue.Queue()
    cache = KVCache(LARGE)
    fill(cache, seed=1)
    prefill = PrefillEndpoint(
        cache,
        MODEL,
        "p-local",
        lambda r, b: released.put((r, b, time.time())),
        KVTransferConfig(lease_s=3.0, reaper_interval_s=0.05),
    )
    info = prefill.start()
    peer = peers["doomed_decode"]
    try:
        assert peer.recv(timeout_s=150) == ("ready",)
        handles = [
            prefill.hand_off(f"r{i}", list(range(16 * i, 16 * i + 16)), [], 256) for i in range(12)
        ]
        peer.conn.send(info)
        peer.conn.send((handles, [h.block_ids for h in handles]))
        wait_for(lambda: prefill.stats().released >= 1, timeout_s=30)  # a pull completed
        peer.kill()
        killed_at = time.time()
        latest_end = max(max(h.lease_deadline for h in handles), killed_at + 1.0)
        wait_for(lambda: len(prefill.leases) == 0, timeout_s=latest_end - time.time() + 5)
    finally:
        peer.kill()
        prefill.close()
    ends = [released.get_nowait() for _ in range(len(handles))]
    assert released.empty()  # exactly one release per handle
    assert sorted(r for r, _, _ in ends) == sorted(h.request_id for h in handles)
    assert prefill.pinned_block_ids() == frozenset()
    # A lease ends at its own deadline or, if the dead decode extended it, at most
    # lease_extension_s after the kill; the reaper (every 0.05 s) frees it just after
    # (1 s of slack for a loaded 2-core machine).
    assert max(at for _, _, at in ends) < latest_end + 1.0
    stats = prefill.stats()
    assert stats.released >= 1 and stats.expired >= 1 and stats.released + stats.expired == 12
