"""Which KV heads each decode rank pulls, from which prefill rank, between tensor-parallel
layouts (pure: no torch, no I/O).

A worker of TP size N holds a model's K KV heads split over its ranks the way
engine/tp/tp_shard.py splits them: rank r holds heads [r*K/N, (r+1)*K/N), or, when N > K (the
heads are replicated), the one head r*K//N. Block ids are the same on every rank, so a
hand-off is, per decode rank, a few head ranges of every block of the prompt:

    for each decode rank d and each KV head h it holds, read h from a prefill rank holding it
    (with replicas, one of them: rank d when it holds h, else the replicas' (d mod count)-th)
    into d's own slot for h; heads adjacent on both sides merge into one `HeadSlice`.

Examples (K = 8): P TP=1 → D TP=2: d reads heads [4d, 4d+4) of P's rank 0 into all of its
pool. P TP=2 → D TP=1: rank 0 reads all of P rank 0 into heads [0, 4) and all of P rank 1
into [4, 8). P TP=2 → D TP=4: d reads heads [2(d%2), 2(d%2)+2) of P rank d//2. Same TP:
rank r reads all of rank r.

A slice is one region of a block only where heads are the outer dimension inside the block
(the head-major pool, engine/kv/kv_cache.py); a slice that is a whole block on both sides is
read as whole blocks in any layout (one region a block, one per layer in a layer-major pool;
adjacent blocks coalesce). So `plan_split` accepts a pair when
every read is a whole block and both sides use the same layout, or when both sides are
head-major; it refuses anything else with `UnsupportedSplit` naming both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_MAJOR = "block_major_v1"
HEAD_MAJOR = "head_major_v1"
"""The layout names of engine/kv/kv_cache.py (the router imports this module without torch)."""


class UnsupportedSplit(ValueError):
    """No hand-off plan exists between these two KV splits (the handshake refuses the pair)."""


@dataclass(frozen=True)
class KVSplit:
    """How one worker holds a model's KV: `tp_size` ranks over `num_kv_heads` (the model's),
    each rank's pool in `layout`."""

    tp_size: int
    num_kv_heads: int
    layout: str

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.num_kv_heads < 1:
            raise UnsupportedSplit(f"{self.describe()}: TP size and KV heads must be >= 1")
        k, n = self.num_kv_heads, self.tp_size
        if k % n and n % k:
            raise UnsupportedSplit(
                f"{self.describe()}: the TP size must divide the KV heads or be a multiple of them"
            )

    def heads_of(self, rank: int) -> range:
        """The model's KV heads rank `rank` holds (engine/tp/tp_shard.py `kv_head_range`)."""
        return kv_heads_of(self.num_kv_heads, self.tp_size, rank)

    @property
    def local_heads(self) -> int:
        """KV heads in each rank's pool."""
        return len(self.heads_of(0))

    def describe(self) -> str:
        return f"TP={self.tp_size} over {self.num_kv_heads} KV heads, {self.layout}"


def kv_heads_of(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """KV heads of rank `rank` of `tp_size` (one replicated head when tp_size > the heads)."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} of TP size {tp_size}")
    if tp_size > num_kv_heads:
        head = rank * num_kv_heads // tp_size
        return range(head, head + 1)
    n = num_kv_heads // tp_size
    return range(rank * n, (rank + 1) * n)


@dataclass(frozen=True)
class HeadSlice:
    """`num_heads` heads read from prefill rank `prefill_rank`'s pool, starting at its local
    head `src_head`, into the decode rank's pool at its local head `dst_head`."""

    prefill_rank: int
    src_head: int
    dst_head: int
    num_heads: int


@dataclass(frozen=True)
class HeadPlan:
    """The reads of a hand-off from a worker split as `prefill` to one split as `decode`:
    `reads[d]` are decode rank d's slices, by ascending `dst_head` (they cover its pool)."""

    prefill: KVSplit
    decode: KVSplit
    reads: tuple[tuple[HeadSlice, ...], ...]

    def is_whole(self, s: HeadSlice) -> bool:
        """The slice is a whole block on both sides."""
        return s.num_heads == self.prefill.local_heads == self.decode.local_heads

    @property
    def whole_blocks(self) -> bool:
        """Every read is a whole block on both sides (no head slicing)."""
        return all(self.is_whole(s) for rank in self.reads for s in rank)


def plan_heads(
    prefill_tp: int, decode_tp: int, num_kv_heads: int
) -> tuple[tuple[HeadSlice, ...], ...]:
    """Per decode rank, the slices it reads (module docstring); raises UnsupportedSplit when
    either TP size does not split `num_kv_heads`."""
    prefill = KVSplit(prefill_tp, num_kv_heads, HEAD_MAJOR)
    decode = KVSplit(decode_tp, num_kv_heads, HEAD_MAJOR)
    holders: dict[int, list[int]] = {}
    for p in range(prefill_tp):
        for h in prefill.heads_of(p):
            holders.setdefault(h, []).append(p)
    out = []
    for d in range(decode_tp):
        slices: list[HeadSlice] = []
        for dst, head in enumerate(decode.heads_of(d)):
            ranks = holders[head]
            p = d if d in ranks else ranks[d % len(ranks)]
            src = head - prefill.heads_of(p).start
            last = slices[-1] if slices else None
            if (
                last is not None
                and last.prefill_rank == p
                and last.src_head + last.num_heads == src
                and last.dst_head + last.num_heads == dst
            ):
                slices[-1] = HeadSlice(p, last.src_head, last.dst_head, last.num_heads + 1)
            else:
                slices.append(HeadSlice(p, src, dst, 1))
        out.append(tuple(slices))
    return tuple(out)


def plan_split(prefill: KVSplit, decode: KVSplit) -> HeadPlan:
    """The plan of a hand-off from a worker split as `prefill` to one split as `decode`, or
    UnsupportedSplit saying why there is none (module docstring), naming both sides."""
    sides = f"prefill {prefill.describe()} → decode {decode.describe()}"
    if prefill.num_kv_heads != decode.num_kv_heads:
        raise UnsupportedSplit(f"{sides}: the models have different KV heads")
    reads = plan_heads(prefill.tp_size, decode.tp_size, prefill.num_kv_heads)
    plan = HeadPlan(prefill, decode, reads)
    if plan.whole_blocks:
        if prefill.layout != decode.layout:
            raise UnsupportedSplit(f"{sides}: the KV layouts differ (both must use one)")
        return plan
    if prefill.layout != HEAD_MAJOR or decode.layout != HEAD_MAJOR:
        raise UnsupportedSplit(
            f"{sides}: each decode rank reads part of a block's KV heads, which is one region "
            f"per block only in {HEAD_MAJOR} on both sides (kv_layout head_major; "
            "`pdserve up` picks it when prefill and decode TP sizes differ)"
        )
    return plan
