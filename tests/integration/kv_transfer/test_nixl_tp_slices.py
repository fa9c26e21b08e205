"""Hand-offs between tensor-parallel layouts over real NIXL (UCX on loopback, CPU): a prefill
worker of TP 2 (a peer process: two agents) to a decode worker of one rank, and one of TP 1 to
a decode worker of TP 2 (two agents in the test process, rank 1's reads through its
`RankEndpoint`). Every decode rank ends with exactly its KV heads; the lease ends once."""

from __future__ import annotations

import queue

import pytest
import torch
from kvt_peer import Peer, wait_released
from kvt_tp_peer import KV_HEADS, MODEL, model_kv, rank_spec, tp_prefill_main

from engine.kv.kv_cache import KVCache
from kv_transfer.backend import TransferBackend
from kv_transfer.config import KVTransferConfig
from kv_transfer.decode_endpoint import DecodeEndpoint
from kv_transfer.manager import TransferOutcome, TransferState
from kv_transfer.nixl_backend import NixlBackend
from kv_transfer.rank_endpoint import RankEndpoint
from kv_transfer.tp_backend import FollowerBackend, TPBackend
from kv_transfer.tp_plan import kv_heads_of

pytestmark = pytest.mark.timeout(240)

CONFIG = KVTransferConfig(capture_telemetry=True, idle_tick_s=0.02, notif_poll_s=0.002)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_nixl_pulls_each_decode_ranks_heads_across_tp_layouts(
    prefill_tp: int, decode_tp: int
) -> None:
    peer = Peer(tp_prefill_main, prefill_tp, CONFIG)
    caches = [KVCache(rank_spec(decode_tp, r)) for r in range(decode_tp)]
    followers = [RankEndpoint(c, "d0", r, "decode", CONFIG) for r, c in enumerate(caches) if r]
    outcomes: queue.Queue[TransferOutcome] = queue.Queue()

    def factory(name: str, cache: KVCache, config: KVTransferConfig) -> TransferBackend:
        rank0 = NixlBackend(name, cache, capture_telemetry=True)
        if decode_tp == 1:
            return rank0
        links = [FollowerBackend(r, f.start(), f, 30.0) for r, f in enumerate(followers, 1)]
        return TPBackend([rank0, *links])

    decode = DecodeEndpoint(caches[0], MODEL, "d0", outcomes.put, outcomes.put, CONFIG, factory)
    try:
        info = peer.recv()
        decode.start()
        decode.add_peer(info)
        blocks, local = [3, 4, 5, 17], [8, 9, 10, 30]
        handle = peer.ask("hand_off", "r1", blocks)
        assert len(handle.agents) == prefill_tp
        plan = decode.submit(handle, local)
        outcome = outcomes.get(timeout=30)
        assert outcome.state is TransferState.DONE, outcome.error
        for r, cache in enumerate(caches):
            heads = kv_heads_of(KV_HEADS, decode_tp, r)
            want = model_kv(blocks)[:, heads.start : heads.stop]
            assert torch.equal(cache.tensor[local], want), f"decode rank {r}"
        # a head slice is one descriptor per block (rank 0's own reads, from telemetry)
        rank0 = plan.for_rank(0)
        if decode_tp == 1:
            assert outcome.posted_descriptors == rank0.num_descriptors == 2 * len(blocks)
        assert wait_released(peer, "r1") == ["r1"]
    finally:
        decode.close()
        for f in followers:
            f.close()
        peer.stop()
