"""TEST-ONLY: a tensor-parallel prefill "worker" in a peer process for the NIXL slice tests: rank
0's `PrefillEndpoint` and a `RankEndpoint` per other rank (one agent each, one process), over
head-major pools whose values say which model head, block and byte they are."""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection

import torch

from engine.kv.kv_cache import HEAD_MAJOR, KVCache, KVCacheSpec
from kv_transfer.config import KVTransferConfig
from kv_transfer.tp_plan import kv_heads_of

MODEL = "nixl-tp-model"
KV_HEADS, BLOCKS, LAYERS, PAGE, DIM = 4, 32, 2, 16, 16


def rank_spec(tp: int, rank: int) -> KVCacheSpec:
    return KVCacheSpec(
        BLOCKS, LAYERS, PAGE, len(kv_heads_of(KV_HEADS, tp, rank)), DIM, "float32",
        layout=HEAD_MAJOR, tp_size=tp, tp_rank=rank, model_kv_heads=KV_HEADS if tp > 1 else 0,
    )  # fmt: skip


def model_kv(blocks: list[int] | None = None) -> torch.Tensor:
    """The whole model's KV, head-major [blocks, model heads, layers, 2, page, dim]."""
    per_head = LAYERS * 2 * PAGE * DIM
    kv = torch.arange(BLOCKS * KV_HEADS * per_head, dtype=torch.float32)
    kv = kv.reshape(BLOCKS, KV_HEADS, LAYERS, 2, PAGE, DIM)
    return kv if blocks is None else kv[blocks]


def tp_prefill_main(conn: Connection, tp: int, config: KVTransferConfig) -> None:
    """Answers hand_off / released / exit."""
    from kv_transfer.prefill_endpoint import PrefillEndpoint
    from kv_transfer.rank_endpoint import RankEndpoint

    caches = []
    for r in range(tp):
        cache = KVCache(rank_spec(tp, r))
        heads = kv_heads_of(KV_HEADS, tp, r)
        cache.tensor.copy_(model_kv()[:, heads.start : heads.stop])
        caches.append(cache)
    followers = [RankEndpoint(c, "p0", r, "prefill", config) for r, c in enumerate(caches) if r]
    released: list[str] = []
    lock = threading.Lock()

    def release(rid: str, blocks: tuple[int, ...]) -> None:
        with lock:
            released.append(rid)

    endpoint = PrefillEndpoint(
        caches[0], MODEL, "p0", release, config, followers=[f.start() for f in followers]
    )
    conn.send(endpoint.start())
    while True:
        cmd, *args = conn.recv()
        if cmd == "hand_off":
            rid, blocks = args
            conn.send(endpoint.hand_off(rid, blocks, [], len(blocks) * PAGE))
        elif cmd == "released":
            with lock:
                conn.send(list(released))
        elif cmd == "exit":
            endpoint.close()
            for f in followers:
                f.close()
            conn.send("bye")
            return
