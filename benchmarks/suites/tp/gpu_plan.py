"""The arithmetic and the plan of the tp_gpu suite (benchmarks/suites/tp/gpu.py), as pure
functions: what one TP rank reads in a decode step (the HBM floor's numerator), how far two
logit vectors are apart, which TP sizes and hand-off pairs (prefill PP x TP → decode PP x TP)
a machine of N GPUs runs and where each rank goes, and what a pair's hand-off posts and moves.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.loading.hf_checkpoint import projection_shapes
from engine.tp.tp_shard import TPShard, local_config
from kv_transfer.tp_plan import (
    BLOCK_MAJOR,
    HEAD_MAJOR,
    LAYER_MAJOR,
    HeadPlan,
    check_handoff_layouts,
)
from vocabulary.model_config import ModelConfig

LOGITS_REL_TOL = 0.1
"""TP=N logits agree with TP=1 when ||a - b|| / ||b|| is at most this. Each of them is off a
float32 reference by bf16 rounding, ~1.5e-2 at Llama-3 sizes (docs/benchmarks.md, "Engine
step (GPU)"), so two of them by up to ~3e-2; a model that drops an all-reduce or splits heads
wrongly is off by order 1."""

# ---- the figures' arithmetic ------------------------------------------------------------------


@dataclass(frozen=True)
class StepBytes:
    """What one rank reads from memory in one decode step."""

    weights: int
    """Its projections' part, norms, biases and the (replicated) head; not the embedding
    table, which is only gathered (unless tied: then it is the head)."""
    kv: int
    """Its KV heads of every sequence's context, every layer, K and V."""

    @property
    def total(self) -> int:
        return self.weights + self.kv


def rank_step_bytes(
    cfg: ModelConfig, tp_size: int, batch: int, context: int, element_size: int
) -> StepBytes:
    """Bytes one rank of TP=`tp_size` reads in a decode step of `batch` sequences of
    `context` tokens each (every rank reads the same: engine/tp/tp_shard.py's split)."""
    local = local_config(cfg, TPShard(tp_size, 0))
    h = cfg.hidden_size
    per_layer = sum(rows * cols for rows, cols in projection_shapes(local).values())
    per_layer += 2 * h  # input and post-attention norms
    if cfg.qk_norm:
        per_layer += 2 * cfg.head_dim
    if cfg.attention_bias:
        per_layer += local.q_size + 2 * local.kv_size
    if cfg.o_proj_bias:
        per_layer += h
    weights = per_layer * cfg.num_layers + h + cfg.vocab_size * h  # + final norm + head
    kv_per_token = cfg.num_layers * 2 * local.num_kv_heads * cfg.head_dim
    return StepBytes(weights * element_size, batch * context * kv_per_token * element_size)


def floor_s(nbytes: int, bandwidths: Sequence[float]) -> float:
    """Seconds for every rank to read `nbytes` at its own bandwidth (bytes/s): the slowest."""
    return max(nbytes / bw for bw in bandwidths)


def logits_rel_diff(got: np.ndarray, want: np.ndarray) -> float:
    """||got - want|| / ||want|| (float64)."""
    a, b = got.astype(np.float64), want.astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---- what runs where ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Skip:
    what: str
    why: str


@dataclass(frozen=True)
class WorkerLayout:
    """One side of a hand-off pair: a worker of `pp` pipeline stages x `tp` TP ranks (ranks
    stage-major, kv_transfer/tp_plan.py; equal stages)."""

    pp: int
    tp: int

    @property
    def num_ranks(self) -> int:
        return self.pp * self.tp

    @property
    def name(self) -> str:
        return f"pp{self.pp}tp{self.tp}"


@dataclass(frozen=True)
class HandoffPair:
    """A prefill worker's layout → a decode worker's."""

    prefill: WorkerLayout
    decode: WorkerLayout

    @property
    def name(self) -> str:
        """`P->D` (TP sizes) between workers of one stage each, else `ppAtpB->ppCtpD`."""
        if self.prefill.pp == self.decode.pp == 1:
            return f"{self.prefill.tp}->{self.decode.tp}"
        return f"{self.prefill.name}->{self.decode.name}"

    @property
    def kv_layout(self) -> str:
        """The pools' layout `pdserve up` gives such a pair (engine.kv_layout auto,
        deploy/control/cluster_spec.py `kv_layout`): head-major when the TP sizes differ (a
        decode rank reads part of a block's heads), else block-major."""
        return HEAD_MAJOR if self.prefill.tp != self.decode.tp else BLOCK_MAJOR

    def plan(self, num_layers: int, num_kv_heads: int) -> HeadPlan:
        """kv_transfer/tp_plan.py's plan of this pair's hand-off for a model of these layers
        and KV heads; raises UnsupportedSplit (a ValueError) saying why there is none (stages
        that do not divide the layers, TP sizes that do not split the heads)."""
        p, d = self.prefill, self.decode
        return check_handoff_layouts(
            p.pp, p.tp, d.pp, d.tp, num_layers, num_kv_heads, self.kv_layout
        )


def tp_pair(prefill_tp: int, decode_tp: int) -> HandoffPair:
    """The pair of workers of one stage each, of these TP sizes."""
    return HandoffPair(WorkerLayout(1, prefill_tp), WorkerLayout(1, decode_tp))


DEFAULT_PAIRS = (
    tp_pair(1, 1), tp_pair(1, 2), tp_pair(2, 1), tp_pair(2, 2),
    HandoffPair(WorkerLayout(2, 1), WorkerLayout(1, 1)),
    HandoffPair(WorkerLayout(2, 1), WorkerLayout(1, 2)),
)  # fmt: skip


@dataclass(frozen=True)
class PairPlacement:
    """The device index of each prefill and decode rank of one hand-off pair (stage-major)."""

    prefill: tuple[int, ...]
    decode: tuple[int, ...]
    mode: str


def plan_decode(tp_size: int, num_devices: int) -> tuple[list[int], list[Skip]]:
    """The TP sizes the decode part runs (1, then `tp_size`) and those it skips."""
    runs, skips = [], []
    for size in dict.fromkeys((1, tp_size)):
        if size <= num_devices:
            runs.append(size)
        else:
            skips.append(
                Skip(
                    f"decode TP={size}",
                    f"needs {size} GPUs (one per rank), this machine has {num_devices}",
                )
            )
    return runs, skips


def plan_pairs(
    pairs: Sequence[HandoffPair], num_devices: int, placement: str
) -> tuple[dict[HandoffPair, PairPlacement], list[Skip]]:
    """Where each pair's ranks go, and the pairs skipped. `placement`: spread (each rank its
    own GPU: as many as the pair's ranks), packed (prefill ranks on GPU 0, decode ranks on
    GPU 1), auto (spread when every pair fits, else packed), single (every rank on GPU 0: a
    check of the VRAM path on one GPU, whose GB/s are a copy inside one GPU, not over a
    link; only when asked for)."""

    def ranks(pair: HandoffPair) -> tuple[int, int]:
        return pair.prefill.num_ranks, pair.decode.num_ranks

    if placement == "single" and num_devices >= 1:
        placed = {}
        for pair in pairs:
            p, d = ranks(pair)
            placed[pair] = PairPlacement((0,) * p, (0,) * d, "single")
        return placed, []
    if num_devices < 2:
        why = (
            f"needs 2 GPUs (the prefill pool and the decode pool on different GPUs), "
            f"this machine has {num_devices}"
        )
        if num_devices == 1:
            why += " (--placement single runs it inside the one GPU: a check, not the figure)"
        return {}, [Skip(f"hand-off {pair.name}", why) for pair in pairs]
    mode = placement
    if mode == "auto":
        mode = "spread" if all(sum(ranks(pair)) <= num_devices for pair in pairs) else "packed"
    placed, skips = {}, []
    for pair in pairs:
        p, d = ranks(pair)
        if mode == "packed":
            placed[pair] = PairPlacement((0,) * p, (1,) * d, mode)
        elif p + d <= num_devices:
            placed[pair] = PairPlacement(tuple(range(p)), tuple(range(p, p + d)), mode)
        else:
            skips.append(
                Skip(
                    f"hand-off {pair.name}",
                    f"spread placement needs {p + d} GPUs (one "
                    f"per rank), this machine has {num_devices}; --placement packed "
                    "puts prefill ranks on GPU 0 and decode ranks on GPU 1",
                )
            )
    return placed, skips


_SIDE = re.compile(r"pp(\d+)tp(\d+)")
PAIR_SYNTAX = (
    "PREFILL_TP-DECODE_TP (workers of one stage, e.g. 2-1) or PREFILL:DECODE with each side "
    "ppSTAGEStpRANKS (e.g. pp2tp1:pp1tp2)"
)


def parse_pairs(text: str) -> tuple[HandoffPair, ...]:
    """`1-1,pp2tp1:pp1tp2` → the pairs; ValueError naming a bad one (`PAIR_SYNTAX`)."""
    out = []
    for item in text.split(","):
        p, sep, d = item.strip().partition("-")
        if sep and p.isdigit() and d.isdigit() and int(p) >= 1 and int(d) >= 1:
            out.append(tp_pair(int(p), int(d)))
            continue
        sides = []
        for side in item.strip().split(":"):
            m = _SIDE.fullmatch(side.strip())
            if m is not None and int(m[1]) >= 1 and int(m[2]) >= 1:
                sides.append(WorkerLayout(int(m[1]), int(m[2])))
        if len(sides) != 2 or item.count(":") != 1:
            raise ValueError(f"pair {item!r}: {PAIR_SYNTAX}")
        out.append(HandoffPair(*sides))
    return tuple(out)


def parse_ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if not values or min(values) < 1:
        raise ValueError(f"{text!r}: positive integers, comma-separated")
    return values


# ---- what a hand-off posts and moves ------------------------------------------------------------


@dataclass(frozen=True)
class ExpectedReads:
    descriptors: int
    """Over every decode rank."""
    per_rank: tuple[int, ...]
    nbytes: int
    """Over every decode rank."""


def expected_reads(plan: HeadPlan, blocks: int, runs: int, unit_nbytes: int) -> ExpectedReads:
    """What a hand-off planned as `plan` of `blocks` blocks, in `runs` runs adjacent on both
    sides, posts and moves, counted from kv_transfer/tp_plan.py's table of regions (not from
    kv_transfer/plan.py, which the benchmark checks against it): a piece that is whole
    segments on both sides (a whole block; whole layers of a layer-major pool) costs its
    regions once per run, any other piece its regions once per block. `unit_nbytes`: one KV
    head's K and V of one layer of one block."""
    per_rank, nbytes = [], 0
    for d in range(plan.decode.num_ranks):
        n = 0
        for _, r, s in plan.pieces(d):
            whole = plan.decode.layout == LAYER_MAJOR or (plan.whole_layers(r) and plan.is_whole(s))
            n += plan.regions(r, s) * (runs if whole else blocks)
            nbytes += blocks * r.num_layers * s.num_heads * unit_nbytes
        per_rank.append(n)
    return ExpectedReads(sum(per_rank), tuple(per_rank), nbytes)
