"""Hand-offs between pipeline-parallel layouts over real NIXL (UCX on loopback, CPU): a prefill
worker of PP=2 (a peer process: two rank agents, each stage's pool filled with its layers of a
model's KV whose every value says where it is) to a decode worker of one rank, and to one of
TP=2 (two agents in the test process, rank 1's reads through its `RankEndpoint`). Every byte
lands where its model layer and head say; nothing else is written; the lease ends once."""

from __future__ import annotations

import queue

import pytest
import torch
from kvt_peer import Peer, wait_released
from kvt_pp_peer import KV, MODEL, pp_prefill_main
from pp_kv import blocks_of, rank_spec, rank_values

from engine.kv.kv_cache import BLOCK_MAJOR, HEAD_MAJOR, LAYER_MAJOR, KVCache
from kv_transfer.backend import TransferBackend
from kv_transfer.config import KVTransferConfig
from kv_transfer.decode_endpoint import DecodeEndpoint
from kv_transfer.manager import TransferOutcome, TransferState
from kv_transfer.nixl_backend import NixlBackend
from kv_transfer.rank_endpoint import RankEndpoint
from kv_transfer.tp_backend import FollowerBackend, TPBackend

pytestmark = pytest.mark.timeout(240)

CONFIG = KVTransferConfig(capture_telemetry=True, idle_tick_s=0.02, notif_poll_s=0.002)
PREFILL_BOUNDS = (0, 1, 4)  # stage 0: layer 0, stage 1: layers 1-3


@pytest.mark.parametrize(
    ("layout", "decode_tp", "descriptors"),
    [
        (BLOCK_MAJOR, 1, 2 * 4),  # a stage's whole block into its layers: one a block each
        (LAYER_MAJOR, 1, 4 * 2),  # a segment per layer, once per run of adjacent blocks (2)
        (HEAD_MAJOR, 2, None),  # each decode rank: one a head, a stage and a block
    ],
)
def test_nixl_pulls_each_stage_s_layers_into_their_place(
    layout: str, decode_tp: int, descriptors: int | None
) -> None:
    peer = Peer(pp_prefill_main, layout, PREFILL_BOUNDS, 1, CONFIG)
    caches = [KVCache(rank_spec(KV, layout, (0, 4), decode_tp, r)) for r in range(decode_tp)]
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
        assert info.split.layer_bounds == PREFILL_BOUNDS and len(info.ranks) == 2
        decode.start()
        decode.add_peer(info)
        blocks, local = [3, 4, 5, 17], [8, 9, 10, 30]
        handle = peer.ask("hand_off", "r1", blocks)
        assert len(handle.agents) == 2
        plan = decode.submit(handle, local)
        outcome = outcomes.get(timeout=30)
        assert outcome.state is TransferState.DONE, outcome.error
        for r, cache in enumerate(caches):
            spec = cache.spec
            want = blocks_of(rank_values(KV, spec), spec, blocks)
            assert torch.equal(blocks_of(cache.tensor, spec, local), want), f"decode rank {r}"
            others = [b for b in range(spec.num_blocks) if b not in local]
            assert not blocks_of(cache.tensor, spec, others).any(), f"decode rank {r}"
        if descriptors is not None:  # rank 0's own reads, from NIXL's telemetry
            assert outcome.posted_descriptors == plan.num_descriptors == descriptors
        else:
            assert len(plan.for_rank(0).slices) == 2 * 2  # 2 heads x 2 stages
        assert wait_released(peer, "r1") == ["r1"]
    finally:
        decode.close()
        for f in followers:
            f.close()
        peer.stop()
