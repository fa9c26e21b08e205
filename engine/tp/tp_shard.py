"""Which part of the model a tensor-parallel rank holds (Megatron's split), as pure functions.

For TP size N and rank r (`TPShard(size=N, rank=r)`), with H query heads, K KV heads and an
intermediate size I:

    q_proj                column-parallel by heads: query heads [r*H/N, (r+1)*H/N)
    k_proj, v_proj        column-parallel by heads: KV heads [r*K/N, (r+1)*K/N); when N > K
                          the KV heads are replicated: rank r holds KV head r*K//N (the one
                          its query heads read, so grouped-query attention stays local)
    gate_proj, up_proj    column-parallel: intermediate rows [r*I/N, (r+1)*I/N)
    o_proj, down_proj     row-parallel: the input columns matching the rows above; each rank's
                          output is a partial sum, summed over the ranks by one all-reduce
                          after each (engine/modeling/llama.py). A row-parallel bias (o_proj's,
                          Llama with attention_bias) is held by rank 0 only, zeros elsewhere, so the
                          all-reduce adds it once.
    everything else       replicated: embeddings, norms, q/k norms (per head_dim), the LM head.

Embeddings and the head are replicated: every rank computes the full logits and only rank 0
samples. Vocab-parallel embeddings and head (an all-gather of the logits per step) were not
measured; for the vocabularies served here (128k x 4096 = 1 GiB in bf16 per rank for
Llama-3-8B) replication costs memory, not a collective.

A rank's model is a `LlamaModel` of `local_config(cfg, shard)` (its head and intermediate
counts), so the attention backends, the KV pool (its KV heads only), CUDA graphs and FP8
calibration see local shapes and need no TP awareness. The loader slices every checkpoint
tensor as it streams (`tensor_slice`; safetensors reads only the slice), FP8 checkpoints
included: a per-output-channel weight scale follows its rows, a per-tensor one is kept. INT4's
packed words and group scales of a row-parallel module are cut by input columns in whole
groups; a split inside a group (or inside a packed word) is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from vocabulary.model_config import ModelConfig

LAYER_TENSOR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.(\w+)$"
)
"""A decoder Linear module's tensor by its Hugging Face name (groups: the module, the kind)."""
COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                   "mlp.gate_proj", "mlp.up_proj")  # fmt: skip
"""Checkpoint modules split by output rows."""
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
"""Checkpoint modules split by input columns (their outputs are all-reduced)."""
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}
"""Each fused projection of engine/modeling/llama.py: its checkpoint modules, in row order."""
PROJECTION_OF = {module: proj for proj, modules in FUSED_MODULES.items() for module in modules}
"""A checkpoint module's fused projection (`self_attn.k_proj` -> `qkv_proj`)."""


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of a tensor-parallel group of `size` ranks (size 1: the whole model)."""

    size: int
    rank: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} of size {self.size}: need 0 <= rank < size")


@dataclass(frozen=True)
class Slice:
    """The part of one checkpoint tensor a rank holds: [start, stop) along `dim` (None: the
    whole tensor); `zeros`: a tensor of the whole's shape, zero (a row-parallel bias on a rank
    other than 0)."""

    dim: int | None = None
    start: int = 0
    stop: int = 0
    zeros: bool = False


WHOLE = Slice()


def check_tp_size(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError, naming the model's counts, unless TP size `size` splits this model:
    it divides the query heads and the intermediate size, and divides the KV heads or is a
    multiple of them (then they are replicated)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {size}")
    if size == 1:
        return
    where = f"tensor_parallel_size={size} does not split {cfg.model_type}"
    if cfg.num_heads % size:
        raise ValueError(f"{where}: {cfg.num_heads} attention heads are not divisible by {size}")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(
            f"{where}: {kv} KV heads neither divide by {size} nor divide it (a TP size above "
            "the KV heads must be a multiple of them, which are then replicated)"
        )
    if cfg.intermediate_size % size:
        raise ValueError(
            f"{where}: intermediate_size {cfg.intermediate_size} is not divisible by {size}"
        )


def local_config(cfg: ModelConfig, shard: TPShard) -> ModelConfig:
    """The config of the part of the model `shard` holds (its heads, KV heads, intermediate
    size); `cfg` itself for size 1."""
    if shard.size == 1:
        return cfg
    check_tp_size(cfg, shard.size)
    return replace(
        cfg,
        num_heads=cfg.num_heads // shard.size,
        num_kv_heads=len(kv_head_range(cfg, shard)),
        intermediate_size=cfg.intermediate_size // shard.size,
    )


def q_head_range(cfg: ModelConfig, shard: TPShard) -> range:
    """The query heads rank `shard.rank` holds."""
    n = cfg.num_heads // shard.size
    return range(shard.rank * n, (shard.rank + 1) * n)


def kv_head_range(cfg: ModelConfig, shard: TPShard) -> range:
    """The KV heads rank `shard.rank` holds (one replicated head when size > num_kv_heads)."""
    kv = cfg.num_kv_heads
    if shard.size > kv:
        head = shard.rank * kv // shard.size
        return range(head, head + 1)
    n = kv // shard.size
    return range(shard.rank * n, (shard.rank + 1) * n)


def _rows(cfg: ModelConfig, shard: TPShard, module: str) -> tuple[int, int, int]:
    """(full output rows, start, stop) of a column-parallel module's rows on this rank, or the
    matching input columns of a row-parallel one."""
    d = cfg.head_dim
    if module in ("self_attn.q_proj", "self_attn.o_proj"):
        heads = q_head_range(cfg, shard)
        return cfg.q_size, heads.start * d, heads.stop * d
    if module in ("self_attn.k_proj", "self_attn.v_proj"):
        heads = kv_head_range(cfg, shard)
        return cfg.kv_size, heads.start * d, heads.stop * d
    n = cfg.intermediate_size // shard.size
    return cfg.intermediate_size, shard.rank * n, (shard.rank + 1) * n


def tensor_slice(name: str, shape: tuple[int, ...], cfg: ModelConfig, shard: TPShard) -> Slice:
    """What rank `shard.rank` holds of the checkpoint tensor `name` (of `shape`); see the
    module docstring. Kinds other than weight and bias (FP8 scales and zero points) follow
    the weight's rows when they have one value per row, and are whole otherwise."""
    m = LAYER_TENSOR.match(name)
    if shard.size == 1 or m is None:
        return WHOLE
    module, kind = m.group(1), m.group(2)
    full, start, stop = _rows(cfg, shard, module)
    if module in ROW_PARALLEL:
        if kind == "weight":
            return Slice(1, start, stop)
        if kind in ("weight_packed", "weight_scale") and len(shape) == 2 and shape[1] > 1:
            return _column_groups(name, shape[1], full, start, stop)
        if kind == "bias" and shard.rank != 0:
            return Slice(zeros=True)
        return WHOLE  # bias on rank 0; scales of the (unsplit) output rows
    if kind in ("weight", "bias") or (len(shape) >= 1 and shape[0] == full):
        return Slice(0, start, stop)
    return WHOLE  # a per-tensor scale


def _column_groups(name: str, columns: int, full: int, start: int, stop: int) -> Slice:
    """The slice of a row-parallel tensor with one column per group of `full // columns`
    input columns (INT4's packed words and group scales): input columns [start, stop) in
    whole groups, or ValueError naming a split inside one."""
    per = full // columns
    if per * columns != full or start % per or stop % per:
        raise ValueError(
            f"tensor {name}: this rank's input columns [{start}, {stop}) split a group of "
            f"{per} (a TP size whose shards hold whole quantization groups only)"
        )
    return Slice(1, start // per, stop // per)


def apply_slice(tensor: torch.Tensor, part: Slice) -> torch.Tensor:
    """`tensor`'s part (a view, or zeros)."""
    if part.zeros:
        return torch.zeros_like(tensor)
    if part.dim is None:
        return tensor
    return tensor.narrow(part.dim, part.start, part.stop - part.start)


def shard_tensor(name: str, tensor: torch.Tensor, cfg: ModelConfig, shard: TPShard) -> torch.Tensor:
    """The part of checkpoint tensor `name` that rank `shard.rank` holds."""
    return apply_slice(tensor, tensor_slice(name, tuple(tensor.shape), cfg, shard))


def shard_fused(
    projection: str, weight: torch.Tensor, cfg: ModelConfig, shard: TPShard
) -> torch.Tensor:
    """The part of a whole fused projection weight (`qkv_proj`, `o_proj`, `gate_up_proj`,
    `down_proj` of engine/modeling/llama.py) that rank `shard.rank` holds, in the fused layout of
    its local config (its q rows, then k, then v; gate, then up)."""
    modules = FUSED_MODULES[projection]
    sizes = [_rows(cfg, TPShard(1, 0), m)[0] for m in modules]
    pieces = torch.split(weight, sizes, dim=0) if len(modules) > 1 else (weight,)
    parts = [
        shard_tensor(f"model.layers.0.{m}.weight", piece, cfg, shard)
        for m, piece in zip(modules, pieces, strict=True)
    ]
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=0)
