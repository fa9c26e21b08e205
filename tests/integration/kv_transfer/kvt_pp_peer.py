"""TEST-ONLY: a pipeline-parallel (x TP) prefill "worker" in a peer process for the NIXL PP
hand-off tests: rank 0's `PrefillEndpoint` and a `RankEndpoint` per other rank (one agent each,
one process, ranks stage-major), over pools holding each rank's part of a model's KV whose
values say which block, layer, head and byte they are (tests/pp_kv.py)."""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection

from pp_kv import model_kv, rank_spec, rank_values

from engine.kv.kv_cache import KVCache
from kv_transfer.config import KVTransferConfig

MODEL = "nixl-pp-model"
KV = model_kv(blocks=32, layers=4, page=16, heads=4, dim=16)


def pp_prefill_main(
    conn: Connection, layout: str, bounds: tuple[int, ...], tp: int, config: KVTransferConfig
) -> None:
    """Answers hand_off / released / exit."""
    from kv_transfer.prefill_endpoint import PrefillEndpoint
    from kv_transfer.rank_endpoint import RankEndpoint

    caches = []
    for r in range((len(bounds) - 1) * tp):
        cache = KVCache(rank_spec(KV, layout, bounds, tp, r))
        cache.tensor.copy_(rank_values(KV, cache.spec))
        caches.append(cache)
    followers = [RankEndpoint(c, "p0", r, "prefill", config) for r, c in enumerate(caches) if r]
    released: list[str] = []
    lock = threading.Lock()

    def release(rid: str, blocks: tuple[int, ...]) -> None:
        with lock:
            released.append(rid)

    endpoint = PrefillEndpoint(
        caches[0], MODEL, "p0", release, config, followers=[f.start() for f in followers],
        layer_bounds=bounds,
    )  # fmt: skip
    conn.send(endpoint.start())
    page = caches[0].spec.block_size
    while True:
        cmd, *args = conn.recv()
        if cmd == "hand_off":
            rid, blocks = args
            conn.send(endpoint.hand_off(rid, blocks, [], len(blocks) * page))
        elif cmd == "released":
            with lock:
                conn.send(list(released))
        elif cmd == "exit":
            endpoint.close()
            for f in followers:
                f.close()
            conn.send("bye")
            return
