"""Which KV each decode rank pulls, from which prefill rank, between pipeline- and
tensor-parallel layouts (pure: no torch, no I/O).

A worker is `pp_size` pipeline stages x `tp_size` tensor-parallel ranks, numbered stage-major
(`rank = stage * tp_size + tp_rank`; rank 0 holds the worker's endpoint). Stage s holds the
model's layers [b[s], b[s+1]) of its `layer_bounds` (vocabulary/pipeline.py); TP rank t holds
the model's K KV heads split the way engine/tp/tp_shard.py splits them: [t*K/N, (t+1)*K/N), or,
when N > K (the heads are replicated), the one head t*K//N. Rank (s, t)'s pool holds exactly
those layers and heads. Block ids are the same on every rank, so a hand-off is, per decode
rank, a few (layer range x head range) pieces of every block of the prompt. The plan is the
product of two independent ones:

    heads (`plan_heads`, per decode TP rank): for each KV head h it holds, read h from a prefill
    TP rank holding it (with replicas, one of them: rank t when it holds h, else the replicas'
    (t mod count)-th) into its own slot for h; heads adjacent on both sides merge into one
    `HeadSlice`.
    layers (`plan_layers`): decode stage s_d reads each range where its layers meet a prefill
    stage's, from that stage (`LayerRange`).

Decode rank (s_d, t_d) reads, for every `LayerRange` of stage s_d and every `HeadSlice` of TP
rank t_d, that range's layers of those heads from prefill rank (range.prefill_stage,
slice.prefill_rank).

Examples, K = 8 KV heads, L = 32 layers. TP only: P TP=1 → D TP=2: d reads heads [4d, 4d+4) of
P's rank 0 into all of its pool. P TP=2 → D TP=1: rank 0 reads all of P rank 0 into heads
[0, 4) and all of P rank 1 into [4, 8). P TP=2 → D TP=4: d reads heads [2(d%2), 2(d%2)+2) of P
rank d//2. Same TP: rank r reads all of rank r. PP: P PP=2 → D PP=1: D rank 0 reads P stage
0's whole pool into layers [0, 16) and stage 1's into [16, 32). P PP=2 (bounds 0,16,32) → D
PP=2 (bounds 0,12,32): D stage 0 reads layers [0, 12) of P stage 0, D stage 1 reads [12, 16) of
P stage 0 and [16, 32) of P stage 1. P PP=2 x TP=2 → D TP=2: D rank t reads P rank t (stage 0)
into layers [0, 16) and P rank 2 + t (stage 1) into [16, 32). P PP=2 x TP=2 → D TP=1: D rank 0
reads heads [0, 4) of layers [0, 16) from P rank 0, heads [4, 8) of them from P rank 1, and
the same of layers [16, 32) from P ranks 2 and 3.

Where a piece lies in a block (engine/kv/kv_cache.py): a block-major block is [layers, 2, page,
heads, dim], so a layer range of all the pool's heads is one region, a head range is not; a
layer-major block is one segment per layer (each [2, page, heads, dim]), so a layer range of
all heads is a run of whole segments (adjacent blocks coalesce in each); a head-major block is
[heads, layers, 2, page, dim], so a head range over all the pool's layers is one region, and a
layer range of a pool's part is one region per head. Regions per block of each piece:

    piece                                  block_major   layer_major        head_major
    whole block both sides (same PP, TP)   1 (coalesce)  1/layer (coalesce) 1 (coalesce)
    all heads, part of the layers          1             1/layer (coalesce) 1 per head
    part of the heads, all layers          refused       refused            1
    part of the heads, part of the layers  refused       refused            1 per head

So `plan_split` accepts a pair when every piece is of all heads on both sides and both sides use
the same layout, or when both sides are head-major; it refuses anything else with
`UnsupportedSplit` naming both sides and what to set. `check_handoff_layouts` is the same check
from the numbers `pdserve up` holds (before any worker starts).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from vocabulary.pipeline import stage_layer_bounds

BLOCK_MAJOR = "block_major_v1"
HEAD_MAJOR = "head_major_v1"
LAYER_MAJOR = "layer_major_v1"
"""The layout names of engine/kv/kv_cache.py (the router imports this module without torch)."""
_LAYOUTS = {"block_major": BLOCK_MAJOR, "head_major": HEAD_MAJOR, "layer_major": LAYER_MAJOR}


class UnsupportedSplit(ValueError):
    """No hand-off plan exists between these two KV splits (the handshake refuses the pair)."""


@dataclass(frozen=True)
class KVSplit:
    """How one worker holds a model's KV: `pp_size` stages x `tp_size` ranks (module docstring:
    rank `stage * tp_size + tp_rank`) over the model's `num_kv_heads` and `num_layers`, each
    rank's pool in `layout`. Every rank of a worker has the same split."""

    tp_size: int
    num_kv_heads: int
    layout: str
    num_layers: int = 0
    """The model's layers (every stage's); 0: not stated, only for a worker of one stage (two
    such workers read each rank's layers as one piece; the compatibility hash vouches that
    their models have the same layers)."""
    layer_bounds: tuple[int, ...] = ()
    """`pp_size + 1` stage boundaries from 0 to `num_layers` (vocabulary/pipeline.py
    `stage_layer_bounds`); empty: one stage holding every layer ((0, num_layers) is kept as
    empty, so a one-stage split has one spelling)."""

    def __post_init__(self) -> None:
        bounds = tuple(int(b) for b in self.layer_bounds)
        if bounds and not self.num_layers:
            object.__setattr__(self, "num_layers", bounds[-1])
        if self.tp_size < 1 or self.num_kv_heads < 1 or self.num_layers < 0:
            raise UnsupportedSplit(
                f"{self.describe()}: TP size and KV heads must be >= 1, layers >= 0"
            )
        k, n = self.num_kv_heads, self.tp_size
        if k % n and n % k:
            raise UnsupportedSplit(
                f"{self.describe()}: the TP size must divide the KV heads or be a multiple of them"
            )
        increasing = all(a < b for a, b in itertools.pairwise(bounds))
        if bounds and (bounds[0] != 0 or bounds[-1] != self.num_layers or not increasing):
            raise UnsupportedSplit(
                f"{self.describe()}: stage bounds {','.join(map(str, bounds))} must rise from 0 "
                f"to the model's {self.num_layers} layers"
            )
        object.__setattr__(self, "layer_bounds", bounds if len(bounds) > 2 else ())

    @property
    def pp_size(self) -> int:
        """Pipeline stages."""
        return max(len(self.layer_bounds) - 1, 1)

    @property
    def num_ranks(self) -> int:
        """Ranks of the worker (every stage's TP ranks)."""
        return self.pp_size * self.tp_size

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, TP rank) of worker rank `rank` (stage-major numbering)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} of {self.ranks_text}")
        return divmod(rank, self.tp_size)

    def heads_of(self, tp_rank: int) -> range:
        """The model's KV heads TP rank `tp_rank` holds (engine/tp/tp_shard.py
        `kv_head_range`), in every stage."""
        return kv_heads_of(self.num_kv_heads, self.tp_size, tp_rank)

    @property
    def local_heads(self) -> int:
        """KV heads in each rank's pool."""
        return len(self.heads_of(0))

    @property
    def ranks_text(self) -> str:
        """`TP size N`, or `PP=P x TP=N (R ranks)`: what a count of rank agents is checked
        against."""
        if self.pp_size == 1:
            return f"TP size {self.tp_size}"
        return f"PP={self.pp_size} x TP={self.tp_size} ({self.num_ranks} ranks)"

    def describe(self) -> str:
        tp = f"TP={self.tp_size} over {self.num_kv_heads} KV heads, {self.layout}"
        if len(self.layer_bounds) <= 2:
            return tp
        bounds = ",".join(map(str, self.layer_bounds))
        return f"PP={self.pp_size} over {self.num_layers} layers (bounds {bounds}) x {tp}"


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
    """`num_heads` heads read from prefill TP rank `prefill_rank`'s pool, starting at its local
    head `src_head`, into the decode rank's pool at its local head `dst_head`."""

    prefill_rank: int
    src_head: int
    dst_head: int
    num_heads: int


@dataclass(frozen=True)
class LayerRange:
    """The model's layers [start, stop), where decode stage `decode_stage`'s layers meet
    prefill stage `prefill_stage`'s: read from that stage."""

    prefill_stage: int
    decode_stage: int
    start: int
    stop: int

    @property
    def num_layers(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class HeadPlan:
    """The reads of a hand-off from a worker split as `prefill` to one split as `decode`:
    `reads[t]` are decode TP rank t's head slices (by ascending `dst_head`, covering its
    heads; the same in every stage), `layers` the stage pairs' layer ranges (by decode stage,
    then layer), over the model's `num_layers` (1 when neither side states them: each rank's
    layers are then one piece). Decode rank d reads `pieces(d)`."""

    prefill: KVSplit
    decode: KVSplit
    reads: tuple[tuple[HeadSlice, ...], ...]
    layers: tuple[LayerRange, ...] = ()
    num_layers: int = 1

    def bounds(self, split: KVSplit) -> tuple[int, ...]:
        """`split`'s stage bounds (one side of this plan) over the plan's layers."""
        return split.layer_bounds or (0, self.num_layers)

    def stage_layers(self, split: KVSplit, stage: int) -> range:
        """The model's layers stage `stage` of `split` (one side of this plan) holds."""
        b = self.bounds(split)
        return range(b[stage], b[stage + 1])

    def is_whole(self, s: HeadSlice) -> bool:
        """The slice is all the heads of the pool on both sides."""
        return s.num_heads == self.prefill.local_heads == self.decode.local_heads

    def whole_layers(self, r: LayerRange) -> bool:
        """The range is all the layers of the pool on both sides."""
        return (
            self.stage_layers(self.prefill, r.prefill_stage)
            == self.stage_layers(self.decode, r.decode_stage)
            == range(r.start, r.stop)
        )

    @property
    def whole_heads(self) -> bool:
        """Every read is all the heads of the pool on both sides (no head slicing)."""
        return all(self.is_whole(s) for rank in self.reads for s in rank)

    @property
    def whole_blocks(self) -> bool:
        """Every read is a whole block on both sides (no head or layer slicing)."""
        return self.whole_heads and all(self.whole_layers(r) for r in self.layers)

    def pieces(self, rank: int) -> tuple[tuple[int, LayerRange, HeadSlice], ...]:
        """Decode rank `rank`'s reads: (prefill rank, layers, heads), by layer then head."""
        stage, tp_rank = self.decode.position(rank)
        return tuple(
            (r.prefill_stage * self.prefill.tp_size + s.prefill_rank, r, s)
            for r in self.layers
            if r.decode_stage == stage
            for s in self.reads[tp_rank]
        )

    def regions(self, r: LayerRange, s: HeadSlice) -> int:
        """Contiguous regions of a block the piece (r, s) is on both sides (module
        docstring's table)."""
        if self.decode.layout == LAYER_MAJOR:
            return r.num_layers
        if self.decode.layout == HEAD_MAJOR and not self.whole_layers(r):
            return s.num_heads
        return 1

    @property
    def regions_per_block(self) -> int:
        """Regions of one block read over every decode rank (descriptors a block when no
        adjacent blocks coalesce)."""
        return sum(
            self.regions(r, s) for d in range(self.decode.num_ranks) for _, r, s in self.pieces(d)
        )


def plan_heads(
    prefill_tp: int, decode_tp: int, num_kv_heads: int
) -> tuple[tuple[HeadSlice, ...], ...]:
    """Per decode TP rank, the slices it reads (module docstring); raises UnsupportedSplit when
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


def plan_layers(
    prefill_bounds: Sequence[int], decode_bounds: Sequence[int]
) -> tuple[LayerRange, ...]:
    """Where each decode stage's layers meet each prefill stage's (both bounds over the same
    layers), by decode stage, then layer."""
    if prefill_bounds[-1] != decode_bounds[-1]:
        raise ValueError(f"stage bounds over {prefill_bounds[-1]} and {decode_bounds[-1]} layers")
    out = []
    for sd in range(len(decode_bounds) - 1):
        for sp in range(len(prefill_bounds) - 1):
            start = max(prefill_bounds[sp], decode_bounds[sd])
            stop = min(prefill_bounds[sp + 1], decode_bounds[sd + 1])
            if start < stop:
                out.append(LayerRange(sp, sd, start, stop))
    return tuple(out)


def plan_split(prefill: KVSplit, decode: KVSplit) -> HeadPlan:
    """The plan of a hand-off from a worker split as `prefill` to one split as `decode`, or
    UnsupportedSplit saying why there is none (module docstring), naming both sides."""
    sides = f"prefill {prefill.describe()} → decode {decode.describe()}"
    if prefill.num_kv_heads != decode.num_kv_heads:
        raise UnsupportedSplit(f"{sides}: the models have different KV heads")
    p_layers, d_layers = prefill.num_layers, decode.num_layers
    if p_layers and d_layers and p_layers != d_layers:
        raise UnsupportedSplit(
            f"{sides}: the models have different layers ({p_layers} and {d_layers})"
        )
    num_layers = p_layers or d_layers or 1
    reads = plan_heads(prefill.tp_size, decode.tp_size, prefill.num_kv_heads)
    layers = plan_layers(
        prefill.layer_bounds or (0, num_layers), decode.layer_bounds or (0, num_layers)
    )
    plan = HeadPlan(prefill, decode, reads, layers, num_layers)
    if not plan.whole_heads:
        if prefill.layout != HEAD_MAJOR or decode.layout != HEAD_MAJOR:
            raise UnsupportedSplit(
                f"{sides}: each decode rank reads part of a block's KV heads, which is one "
                f"region per block only in {HEAD_MAJOR} on both sides (kv_layout head_major; "
                "`pdserve up` picks it when prefill and decode TP sizes differ)"
            )
    elif prefill.layout != decode.layout:
        raise UnsupportedSplit(f"{sides}: the KV layouts differ (both must use one)")
    return plan


def check_handoff_layouts(
    prefill_pp: int,
    prefill_tp: int,
    decode_pp: int,
    decode_tp: int,
    num_layers: int,
    num_kv_heads: int,
    layout: str,
    prefill_partition: Sequence[int] = (),
    decode_partition: Sequence[int] = (),
) -> HeadPlan:
    """The plan of a hand-off from prefill workers of `prefill_pp` stages x `prefill_tp` ranks
    to decode workers of `decode_pp` x `decode_tp`, of a model of `num_layers` layers and
    `num_kv_heads` KV heads, every pool in `layout` (`block_major_v1` or `block_major`, ...),
    each side's stages cut by its partition (layer counts; empty: equal stages). Pure, for
    `pdserve up` to call before anything starts; raises UnsupportedSplit naming the numbers
    and what to set when a side's stages or TP size cannot cut the model, or no plan reads
    the pair."""
    name = _LAYOUTS.get(layout, layout)
    if name not in _LAYOUTS.values():
        raise UnsupportedSplit(f"KV layout {layout!r}: one of {', '.join(_LAYOUTS)}")
    splits = []
    for side, pp, tp, partition in (
        ("prefill", prefill_pp, prefill_tp, prefill_partition),
        ("decode", decode_pp, decode_tp, decode_partition),
    ):
        try:
            bounds = stage_layer_bounds(num_layers, pp, partition)
            splits.append(KVSplit(tp, num_kv_heads, name, num_layers, bounds))
        except ValueError as e:  # (UnsupportedSplit is one)
            raise UnsupportedSplit(f"{side} workers: {e}") from None
    return plan_split(*splits)
