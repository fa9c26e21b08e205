"""NIXL descriptors per KV transfer under allocation churn: how many runs of adjacent block ids
(one descriptor each, kv_transfer/plan.py) a pulled prompt needs once both pools have cycled.

Two real `BlockPool`s (prefill side, decode side) with prefix caching on serve a steady stream
of requests (a fixed number in flight, random prompt lengths, each finished request's full
blocks left in the prefix cache, so later allocations evict them LRU). Each new request
allocates its blocks on both sides and is planned as a transfer; the second half of the run
is measured. Side by side in one run: the pool as it is (ids handed out ascending) and the
hand-out order it used before (free list / LRU pop order, a freed sequence's tail first),
reproduced here as the baseline. The transfer time is modelled as
t = descriptors x 7 us + bytes / 390 GB/s for 2 MiB blocks (one 16-token block of a Llama-3-8B
shape, block-major): the fixed cost per descriptor and the peer copy rate of NIXL VRAM reads
between two H200s (docs/benchmarks.md, "GPU: KV transfer").

    python benchmarks/bench_kv_runs.py
    python benchmarks/bench_kv_runs.py --blocks 60000 --in-flight 64 --max-prompt-blocks 256
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kv.block_pool import BlockPool
from kv_transfer.plan import coalesce_runs
from vocabulary.block_hash import BlockHash

DESCRIPTOR_S = 7e-6
LINK_BPS = 390e9
BLOCK_BYTES = 2 << 20


def simulate(ordered: bool, args: argparse.Namespace) -> tuple[float, float]:
    """(mean descriptors, mean blocks) per transfer in the measured half."""
    rng = random.Random(args.seed)
    pools = [BlockPool(args.blocks), BlockPool(args.blocks)]
    live: list[tuple[list[int], list[int]]] = []
    descriptors = blocks = measured = 0
    for step in range(args.requests):
        need = rng.randint(args.min_prompt_blocks, args.max_prompt_blocks)
        while len(live) >= args.in_flight or not all(p.can_allocate(need) for p in pools):
            for pool, ids in zip(pools, live.pop(rng.randrange(len(live))), strict=True):
                pool.free(ids)
        got = []
        for pool in pools:
            # the order the pool used to hand blocks out in: free list first (oldest freed
            # first), then LRU evictions (least recently freed first); a benchmark may peek
            popped = (list(pool._free) + list(pool._evictable))[:need]
            ids = pool.allocate(need)
            if not ordered:
                assert sorted(popped) == ids
                ids = popped
            chain = [BlockHash(f"{step}/{i}".encode()) for i in range(len(ids) - 1)]
            pool.cache_blocks(ids[:-1], chain)  # the full blocks stay in the prefix cache
            pool.take_events()
            got.append(ids)
        if step >= args.requests // 2:
            descriptors += len(coalesce_runs(got[0], got[1]))
            blocks += need
            measured += 1
        live.append((got[0], got[1]))
    return descriptors / measured, blocks / measured


def model_ms(descriptors: float, blocks: float) -> float:
    return 1000 * (descriptors * DESCRIPTOR_S + blocks * BLOCK_BYTES / LINK_BPS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--blocks", type=int, default=8192, help="blocks per pool")
    ap.add_argument("--in-flight", type=int, default=24, help="requests holding blocks")
    ap.add_argument("--min-prompt-blocks", type=int, default=8)
    ap.add_argument("--max-prompt-blocks", type=int, default=200)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(
        f"pools of {args.blocks} blocks, {args.in_flight} requests in flight, prompts of "
        f"{args.min_prompt_blocks}-{args.max_prompt_blocks} blocks, {args.requests} requests"
    )
    rows = []
    for name, ordered in (("hand-out order (before)", False), ("ascending ids (now)", True)):
        desc, blocks = simulate(ordered, args)
        rows.append((name, desc, blocks))
    ideal = model_ms(1, rows[0][2])
    print(f"{'allocation':<26}{'blocks/transfer':>16}{'descriptors':>13}{'model ms':>10}"
          f"{'vs one descriptor':>19}")  # fmt: skip
    for name, desc, blocks in rows:
        ms = model_ms(desc, blocks)
        print(f"{name:<26}{blocks:>16.1f}{desc:>13.1f}{ms:>10.3f}{ms / ideal:>18.2f}x")


if __name__ == "__main__":
    main()
