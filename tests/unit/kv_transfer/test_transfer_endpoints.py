"""Prefill and decode endpoints with their threads, over the test-only loopback backend.

Real time, short timers: these check that the reaper and the deadlines run on their own
(no new work needed), and that callbacks arrive exactly once.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from kvt_factories import MODEL, SPEC, LoopbackFabric, filled_cache, loopback_factory

from engine.kv.kv_cache import KVCache
from kv_transfer.config import KVTransferConfig
from kv_transfer.decode_endpoint import DecodeEndpoint
from kv_transfer.manager import TransferOutcome, TransferState
from kv_transfer.prefill_endpoint import PrefillEndpoint
from vocabulary.kv_events import KVTier
from vocabulary.transfer_errors import HandshakeError, TransferTimeout, UnknownPeer

pytestmark = pytest.mark.timeout(30)

FAST = KVTransferConfig(
    lease_s=5.0, reaper_interval_s=0.02, idle_tick_s=0.02, heartbeat_interval_s=0.05
)


class Pair:
    def __init__(
        self,
        fabric: LoopbackFabric,
        config: KVTransferConfig = FAST,
        host: torch.Tensor | None = None,
    ) -> None:
        """`host`: the prefill worker's host tier ([blocks, *block]), registered as a region."""
        self.released: queue.Queue[tuple[str, tuple[int, ...], float]] = queue.Queue()
        self.outcomes: queue.Queue[TransferOutcome] = queue.Queue()
        self.callback_threads: list[str] = []
        self.prefill_cache = filled_cache(seed=3)
        self.prefill = PrefillEndpoint(
            self.prefill_cache,
            MODEL,
            "p0",
            lambda rid, blocks: self.released.put((rid, blocks, time.monotonic())),
            config,
            loopback_factory(fabric),
            tiers={KVTier.HOST: host} if host is not None else None,
        )
        self.decode_cache = KVCache(SPEC)
        self.decode = DecodeEndpoint(
            self.decode_cache,
            MODEL,
            "d0",
            self._on_outcome,
            self._on_outcome,
            config,
            loopback_factory(fabric),
        )
        self.info = self.prefill.start()
        self.decode.start()

    def _on_outcome(self, outcome: TransferOutcome) -> None:
        self.callback_threads.append(threading.current_thread().name)
        self.outcomes.put(outcome)

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()


@pytest.fixture()
def fabric() -> LoopbackFabric:
    return LoopbackFabric()


@pytest.fixture()
def pair(fabric: LoopbackFabric) -> Iterator[Pair]:
    p = Pair(fabric)
    yield p
    p.close()


def test_hand_off_pull_and_release_over_the_loop_threads(pair: Pair) -> None:
    pair.decode.add_peer(pair.info)
    pair.decode.add_peer(pair.info)  # idempotent
    assert pair.decode.has_peer(pair.info.agent_name)
    handle = pair.prefill.hand_off("r1", [7, 8, 2], [], num_tokens=10)
    assert pair.prefill.pinned_block_ids() == frozenset({2, 7, 8})
    plan = pair.decode.submit(handle, [30, 31, 40])
    outcome = pair.outcomes.get(timeout=5)
    assert (outcome.request_id, outcome.state, outcome.plan) == ("r1", TransferState.DONE, plan)
    assert torch.equal(pair.decode_cache.tensor[[30, 31, 40]], pair.prefill_cache.tensor[[7, 8, 2]])
    rid, blocks, _ = pair.released.get(timeout=5)
    assert (rid, blocks) == ("r1", (7, 8, 2))
    assert pair.prefill.stats().released == 1 and pair.prefill.pinned_block_ids() == frozenset()
    assert pair.decode.stats().transfers_done == 1
    assert pair.decode.load().in_flight_blocks == 0
    assert pair.callback_threads == ["kv-decode-d0"]  # the transfer thread, not the caller


def test_reaper_frees_an_expired_lease_on_its_timer(pair: Pair) -> None:
    start = time.monotonic()
    pair.prefill.hand_off("r1", [1, 2], [], num_tokens=8, lease_s=0.2)
    rid, blocks, at = pair.released.get(timeout=5)  # nobody calls the endpoint meanwhile
    assert (rid, blocks) == ("r1", (1, 2))
    assert 0.2 <= at - start < 0.2 + 0.3
    assert pair.prefill.stats().expired == 1 and not pair.prefill.is_pinned(1)


def test_decode_deadline_fires_on_its_timer_and_frees_the_blocks(
    fabric: LoopbackFabric, pair: Pair
) -> None:
    fabric.auto_complete = False  # the read never finishes
    pair.decode.add_peer(pair.info)
    handle = pair.prefill.hand_off("r1", [1], [], num_tokens=4)
    start = time.monotonic()
    pair.decode.submit(handle, [9], deadline=time.time() + 0.2)
    outcome = pair.outcomes.get(timeout=5)
    assert outcome.state is TransferState.EXPIRED and isinstance(outcome.error, TransferTimeout)
    assert outcome.plan.local_block_ids == (9,)
    # its own timer, not the 5 s lease (0.3 s of slack was passed at load average ~9)
    assert time.monotonic() - start < 0.2 + 2.0
    rid, _, _ = pair.released.get(timeout=5)  # decode's abort notice ends the lease early
    assert rid == "r1" and pair.prefill.stats().aborted == 1


def test_submit_raises_for_unknown_peer_and_incompatible_peer_is_refused(
    fabric: LoopbackFabric, pair: Pair
) -> None:
    handle = pair.prefill.hand_off("r1", [1], [], num_tokens=4)
    with pytest.raises(UnknownPeer):
        pair.decode.submit(handle, [9])
    other_cache = KVCache(dataclasses.replace(SPEC, block_size=8))
    other = PrefillEndpoint(
        other_cache, MODEL, "p1", lambda r, b: None, FAST, loopback_factory(fabric)
    )
    try:
        with pytest.raises(HandshakeError, match="block_size: peer 8 vs local 4"):
            pair.decode.add_peer(other.start())
    finally:
        other.close()
    assert pair.outcomes.empty() and pair.decode.load().queued_transfers == 0


def test_close_releases_every_held_lease_and_fails_pending_pulls(fabric: LoopbackFabric) -> None:
    p = Pair(fabric)
    fabric.auto_complete = False
    p.decode.add_peer(p.info)
    p.decode.submit(p.prefill.hand_off("r1", [1], [], num_tokens=4), [5])
    p.prefill.hand_off("r2", [2], [], num_tokens=4)
    p.close()
    assert p.outcomes.get(timeout=5).state is TransferState.FAILED
    assert sorted(p.released.get(timeout=5)[0] for _ in range(2)) == ["r1", "r2"]


# -- a hand-off whose blocks are partly in the prefill worker's host tier ---------------------


@pytest.fixture()
def tiered(fabric: LoopbackFabric) -> Iterator[Pair]:
    host = -torch.arange(16 * math.prod(SPEC.shape[1:]), dtype=torch.float32)
    p = Pair(fabric, host=host.reshape(16, *SPEC.shape[1:]))
    yield p
    p.close()


def test_host_tier_blocks_are_read_from_the_prefill_workers_host_region(tiered: Pair) -> None:
    info = tiered.info
    assert [r.tier for r in info.tier_regions] == [KVTier.HOST]
    tiered.decode.add_peer(info)
    host, dev = KVTier.HOST, KVTier.DEVICE
    # host slots 4, 5 (a prefix lent from the host tier), then device blocks 7, 4: the same
    # id in two regions is two blocks
    handle = tiered.prefill.hand_off(
        "r1", [4, 5, 7, 4], [b"a" * 16, b"b" * 16, b"c" * 16], num_tokens=15,
        block_tiers=[host, host, dev, dev],
    )  # fmt: skip
    assert tiered.prefill.pinned_block_ids() == frozenset({7, 4})  # the pool's, by the lease
    plan = tiered.decode.submit(handle, [20, 21, 22, 30])
    assert [(r.remote_tier, r.remote_start, r.num_blocks) for r in plan.runs] == [
        (host, 4, 2), (dev, 7, 1), (dev, 4, 1)
    ]  # fmt: skip
    assert tiered.outcomes.get(timeout=5).state is TransferState.DONE
    host_kv = tiered.prefill.tiers[KVTier.HOST]
    assert torch.equal(tiered.decode_cache.tensor[[20, 21]], host_kv[[4, 5]])
    assert torch.equal(tiered.decode_cache.tensor[[22, 30]], tiered.prefill_cache.tensor[[7, 4]])
    rid, _, _ = tiered.released.get(timeout=5)  # one notice, after every region's read
    assert rid == "r1" and tiered.prefill.pinned_block_ids() == frozenset()


def test_reused_blocks_skip_their_host_tier_part_too(tiered: Pair) -> None:
    tiered.decode.add_peer(tiered.info)
    handle = tiered.prefill.hand_off(
        "r1", [4, 9], [b"a" * 16], num_tokens=6, block_tiers=[KVTier.HOST, KVTier.DEVICE]
    )
    plan = tiered.decode.submit(handle, [31], num_reused=1)
    assert plan.remote_tiers == () and plan.remote_block_ids == (9,)  # from the pool only
    assert tiered.outcomes.get(timeout=5).state is TransferState.DONE


def test_a_hand_off_names_blocks_only_within_its_tiers_regions(pair: Pair, tiered: Pair) -> None:
    with pytest.raises(ValueError, match="outside its tier"):
        pair.prefill.hand_off("r1", [1], [], num_tokens=4, block_tiers=[KVTier.HOST])
    with pytest.raises(ValueError, match="outside its tier"):
        tiered.prefill.hand_off("r2", [16], [], num_tokens=4, block_tiers=[KVTier.HOST])
    assert pair.prefill.stats().granted == tiered.prefill.stats().granted == 0
