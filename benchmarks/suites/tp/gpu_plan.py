"""The arithmetic and the plan of the tp_gpu suite (benchmarks/suites/tp/gpu.py), as pure
functions: what one TP
rank reads in a decode step (the HBM floor's numerator), how far two logit vectors are apart,
which TP sizes and hand-off pairs a machine of N GPUs runs and where each rank goes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.loading.hf_checkpoint import projection_shapes
from engine.tp.tp_shard import TPShard, local_config
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
class PairPlacement:
    """The device index of each prefill and decode rank of one hand-off pair."""

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
    pairs: Sequence[tuple[int, int]], num_devices: int, placement: str
) -> tuple[dict[tuple[int, int], PairPlacement], list[Skip]]:
    """Where each pair's ranks go, and the pairs skipped. `placement`: spread (each rank its
    own GPU: P + D of them), packed (prefill ranks on GPU 0, decode ranks on GPU 1), auto
    (spread when every pair fits, else packed), single (every rank on GPU 0: a check of the
    VRAM path on one GPU, whose GB/s are a copy inside one GPU, not over a link; only when
    asked for)."""
    if placement == "single" and num_devices >= 1:
        return {(p, d): PairPlacement((0,) * p, (0,) * d, "single") for p, d in pairs}, []
    if num_devices < 2:
        why = (
            f"needs 2 GPUs (the prefill pool and the decode pool on different GPUs), "
            f"this machine has {num_devices}"
        )
        if num_devices == 1:
            why += " (--placement single runs it inside the one GPU: a check, not the figure)"
        return {}, [Skip(f"hand-off {p}->{d}", why) for p, d in pairs]
    mode = placement
    if mode == "auto":
        mode = "spread" if all(p + d <= num_devices for p, d in pairs) else "packed"
    placed, skips = {}, []
    for p, d in pairs:
        if mode == "packed":
            placed[(p, d)] = PairPlacement((0,) * p, (1,) * d, mode)
        elif p + d <= num_devices:
            placed[(p, d)] = PairPlacement(tuple(range(p)), tuple(range(p, p + d)), mode)
        else:
            skips.append(
                Skip(
                    f"hand-off {p}->{d}",
                    f"spread placement needs {p + d} GPUs (one "
                    f"per rank), this machine has {num_devices}; --placement packed "
                    "puts prefill ranks on GPU 0 and decode ranks on GPU 1",
                )
            )
    return placed, skips


def parse_pairs(text: str) -> tuple[tuple[int, int], ...]:
    """`1-1,1-2` → ((1, 1), (1, 2)); ValueError naming a bad pair."""
    out = []
    for item in text.split(","):
        p, sep, d = item.strip().partition("-")
        if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
            raise ValueError(f"pair {item!r}: PREFILL_TP-DECODE_TP, e.g. 2-1")
        out.append((int(p), int(d)))
    return tuple(out)


def parse_ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if not values or min(values) < 1:
        raise ValueError(f"{text!r}: positive integers, comma-separated")
    return values
