"""Descriptors and bytes of one KV hand-off between tensor-parallel layouts, block-major vs
head-major pools (kv_transfer/tp_plan.py plans the reads; engine/kv/kv_cache.py the layouts).

Computed, for a prompt of `--prompt-tokens` tokens, for each prefill → decode TP pair, for the
tiny model (2 KV heads) and a Llama-3-8B shape (8 KV heads, 32 layers, head_dim 128, bf16):

- descriptors: what every decode rank posts, summed. A read of whole blocks is one descriptor
  per run of blocks adjacent on both sides ("contiguous": the prompt's blocks allocated in one
  run on both workers; "scattered": no two adjacent); a head range of a head-major block is
  one descriptor per block; in a block-major block the same heads are one piece per layer,
  K/V and token (layers * 2 * block_size per block), which the handshake refuses to serve;
- bytes: every decode rank's bytes, summed (each head a decode rank holds, once; a head that
  TP replicates, once per rank holding it).

With `--measure`, the tiny model's head-major hand-offs also run over real NIXL (UCX on
loopback, every rank's agent in this process, the decode followers' reads through their
`RankEndpoint`s as in a worker): rank 0's posted descriptors from NIXL telemetry (checked
against the computed count) and the wall time of a hand-off, median of `--repeats`.

    python -m benchmarks tp_handoff
    python -m benchmarks tp_handoff --measure --repeats 20
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks.harness.table import Table
from kv_transfer.plan import coalesce_runs
from kv_transfer.tp_plan import (
    BLOCK_MAJOR,
    HEAD_MAJOR,
    KVSplit,
    UnsupportedSplit,
    kv_heads_of,
    plan_split,
)

PAIRS = ((1, 1), (1, 2), (2, 1), (2, 2), (2, 4))


@dataclass(frozen=True)
class Shape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    element_size: int

    def head_nbytes(self, block_size: int) -> int:
        """One KV head's part of a block: all layers' K and V of `block_size` tokens."""
        return self.num_layers * 2 * block_size * self.head_dim * self.element_size


SHAPES = (
    Shape("tiny (2 KV heads, 4 layers, dim 32, fp32)", 4, 2, 32, 4),
    Shape("Llama-3-8B (8 KV heads, 32 layers, dim 128, bf16)", 32, 8, 128, 2),
)


@dataclass(frozen=True)
class HandOff:
    supported: bool
    contiguous: int
    scattered: int
    nbytes: int
    per_rank: tuple[int, ...]  # descriptors of each decode rank (contiguous)


def hand_off(shape: Shape, p: int, d: int, layout: str, blocks: int, page: int) -> HandOff:
    """What one hand-off of `blocks` blocks posts and moves (module docstring)."""
    k = shape.num_kv_heads
    split = (KVSplit(p, k, HEAD_MAJOR), KVSplit(d, k, HEAD_MAJOR))
    plan = plan_split(*split)  # the reads: the same heads whatever the layout
    try:
        plan_split(KVSplit(p, k, layout), KVSplit(d, k, layout))
        supported = True
    except UnsupportedSplit:
        supported = False
    contiguous_runs = len(coalesce_runs(range(blocks), range(blocks)))
    scattered_runs = len(coalesce_runs(range(0, 2 * blocks, 2), range(blocks)))
    per_piece = shape.num_layers * 2 * page  # pieces of a head range in a block-major block
    per_rank, scattered, nbytes = [], 0, 0
    for rank_reads in plan.reads:
        n = 0
        for s in rank_reads:
            nbytes += blocks * s.num_heads * shape.head_nbytes(page)
            if plan.is_whole(s):
                n += contiguous_runs
                scattered += scattered_runs
            else:
                per_block = 1 if layout == HEAD_MAJOR else per_piece
                n += blocks * per_block
                scattered += blocks * per_block
        per_rank.append(n)
    return HandOff(supported, sum(per_rank), scattered, nbytes, tuple(per_rank))


def print_table(prompt_tokens: int, page: int) -> None:
    blocks = -(-prompt_tokens // page)
    header = ("P->D", "layout", "served", "descriptors", "(scattered)", "per decode rank",
              "MiB moved")  # fmt: skip
    for shape in SHAPES:
        print(f"\n{shape.name}: {prompt_tokens}-token prompt = {blocks} blocks of {page}")
        rows = []
        for p, d in PAIRS:
            for layout in (BLOCK_MAJOR, HEAD_MAJOR):
                h = hand_off(shape, p, d, layout, blocks, page)
                served = "yes" if h.supported else "no"
                rows.append((f"{p}->{d}", layout.removesuffix("_v1"), served, f"{h.contiguous}",
                             f"{h.scattered}", "/".join(map(str, h.per_rank)),
                             f"{h.nbytes / 2**20:.2f}"))  # fmt: skip
        print(Table.of(header, rows, "lrrrrrr").plain())


# ---- measured: real NIXL, tiny model shape ---------------------------------------------------


def release_into(released: queue.Queue[str]) -> Callable[[str, tuple[int, ...]], None]:
    """A prefill endpoint's `release_blocks` that records the request ids released."""

    def release(request_id: str, block_ids: tuple[int, ...]) -> None:
        released.put(request_id)

    return release


def measure(prompt_tokens: int, page: int, repeats: int) -> None:
    os.environ.setdefault("UCX_TLS", "shm,tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from engine.kv.kv_cache import KVCache, KVCacheSpec
    from kv_transfer.backend import TransferBackend
    from kv_transfer.config import KVTransferConfig
    from kv_transfer.decode_endpoint import DecodeEndpoint
    from kv_transfer.manager import TransferOutcome, TransferState
    from kv_transfer.nixl_backend import NixlBackend
    from kv_transfer.prefill_endpoint import PrefillEndpoint
    from kv_transfer.rank_endpoint import RankEndpoint
    from kv_transfer.tp_backend import FollowerBackend, TPBackend

    shape = SHAPES[0]
    k = shape.num_kv_heads
    blocks = -(-prompt_tokens // page)
    num_blocks = 2 * blocks + 8
    config = KVTransferConfig(capture_telemetry=True, idle_tick_s=0.01, notif_poll_s=0.001)

    def spec(tp: int, rank: int) -> KVCacheSpec:
        return KVCacheSpec(
            num_blocks, shape.num_layers, page, len(kv_heads_of(k, tp, rank)), shape.head_dim,
            "float32", layout=HEAD_MAJOR, tp_size=tp, tp_rank=rank,
            model_kv_heads=k if tp > 1 else 0,
        )  # fmt: skip

    print(f"\nmeasured (NIXL over UCX, one process, tiny shape, head-major, {blocks} blocks, "
          f"median of {repeats}):")  # fmt: skip
    rows = []
    for p, d in PAIRS:
        released: queue.Queue[str] = queue.Queue()
        outcomes: queue.Queue[TransferOutcome] = queue.Queue()
        p_caches = [KVCache(spec(p, r)) for r in range(p)]
        for c in p_caches:
            c.tensor.normal_()
        p_ranks = [RankEndpoint(c, "p0", r, "prefill", config) for r, c in enumerate(p_caches) if r]
        prefill = PrefillEndpoint(
            p_caches[0], "bench", "p0", release_into(released), config,
            followers=[r.start() for r in p_ranks],
        )  # fmt: skip
        d_caches = [KVCache(spec(d, r)) for r in range(d)]
        d_ranks = [RankEndpoint(c, "d0", r, "decode", config) for r, c in enumerate(d_caches) if r]

        def factory(
            name: str, cache: KVCache, cfg: KVTransferConfig, ranks: list[RankEndpoint] = d_ranks
        ) -> TransferBackend:
            rank0 = NixlBackend(name, cache, capture_telemetry=True)
            links = [FollowerBackend(r, e.start(), e, 30.0) for r, e in enumerate(ranks, 1)]
            return TPBackend([rank0, *links]) if links else rank0

        decode = DecodeEndpoint(
            d_caches[0], "bench", "d0", outcomes.put, outcomes.put, config, factory
        )
        try:
            info = prefill.start()
            decode.start()
            decode.add_peer(info)
            times, posted = [], None
            for i in range(repeats + 1):
                handle = prefill.hand_off(f"r{i}", list(range(blocks)), [], blocks * page)
                t0 = time.perf_counter()
                plan = decode.submit(handle, list(range(blocks, 2 * blocks)))
                outcome = outcomes.get(timeout=60)
                assert outcome.state is TransferState.DONE, outcome.error
                released.get(timeout=60)
                if i:  # the first one warms up the prepped dlists
                    times.append(time.perf_counter() - t0)
                posted = outcome.posted_descriptors
            computed = plan.for_rank(0).num_descriptors if plan.slices else plan.num_descriptors
            rows.append((f"{p}->{d}", f"{posted}" if d == 1 else "-", f"{computed}",
                         f"{statistics.median(times) * 1e3:.2f}"))  # fmt: skip
            for r, cache in enumerate(d_caches):  # every decode rank got its heads
                assert bool(cache.tensor[blocks : 2 * blocks].abs().sum() > 0), r
        finally:
            decode.close()
            prefill.close()
            for e in [*p_ranks, *d_ranks]:
                e.close()
    header = ("P->D", "rank-0 descriptors", "computed", "ms/hand-off")
    print(Table.of(header, rows).plain())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--measure", action="store_true", help="also run the tiny shape over NIXL")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    print_table(args.prompt_tokens, args.block_size)
    if args.measure:
        measure(args.prompt_tokens, args.block_size, args.repeats)
