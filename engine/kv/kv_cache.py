"""The paged KV memory of one worker: allocated once, addressable per block.

Three layouts. Two are block-first (a block is one contiguous region of `block_nbytes`):

- `block_major_v1` (the default): [num_blocks, num_layers, 2 (K, V), block_size,
  num_kv_heads, head_dim]. Why: NIXL has a fixed cost per descriptor and moves small
  descriptors far below the link rate (one page of one layer of Llama-3-8B is 64 KiB);
  block-major makes one block one descriptor (2 MiB for Llama-3-8B at block size 16), and
  adjacent blocks coalesce further.
- `head_major_v1`: [num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim]. A block is
  still one region, and inside it each KV head's part (all layers' K and V of that head) is
  one contiguous region of `head_nbytes`, so a contiguous range of heads is one region too.
  That is what a hand-off between different tensor-parallel layouts reads (a decode rank
  pulls only the heads it owns, kv_transfer/tp_plan.py): one descriptor per block, where
  block-major would need one per layer, K/V and token (1024 a block for Llama-3-8B).

The third is layer-first:
- `layer_major_v1`: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim], each
  layer's pages together (vLLM's and TensorRT-LLM's order). Why: in a block-first pool one
  layer's pages lie a whole block apart (2.6 MiB for Llama-3-70B in e4m3), so a decode step's
  attention over B=64 x 2048 tokens touches 8192 distinct 2 MiB GPU pages a layer and misses
  the TLB; on an H100 with the 70B shape both decode kernels take ~20 µs a layer more over a
  40- or 80-layer block-major pool than over a layer-major one (docs/benchmarks.md, "Decode
  attention kernels"). The price is on the wire: a block is `num_layers`
  segments of `segment_nbytes`, `num_blocks * segment_nbytes` apart, so a hand-off moves one
  descriptor per layer for each run of adjacent blocks (kv_transfer/backend.py MemoryRegion).

`layer(i)` gives attention the same logical per-layer view for all, [num_blocks, 2,
block_size, kv_heads, head_dim] (flashinfer's NHD paged layout): `tensor[:, i]` for
block-major, a strided permutation of `tensor[:, :, i]` for head-major, `tensor[i]` for
layer-major. `KVCacheSpec.block_dim` is the dimension block ids index. Kernels that read
strides take either (the torch backend; flashinfer reads page, token and head strides);
one that assumes a token's heads are adjacent (the fused e4m3 KV store,
engine/quantization/fp8_kernels.py) runs on block- and layer-major, and head-major writes through
the view. The host tier copies whole blocks in the pool's own layout. Figures:
docs/benchmarks.md, "KV transfer" and "Engine step (GPU)".

Tensor parallelism (engine/tp/tp_shard.py): each rank has a pool of its own holding only its KV
heads (`num_kv_heads` is the rank's count, `model_kv_heads` the model's), with the same
block ids on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK_MAJOR = "block_major_v1"
HEAD_MAJOR = "head_major_v1"
LAYER_MAJOR = "layer_major_v1"
KV_LAYOUT = BLOCK_MAJOR
"""The default layout."""
KV_LAYOUTS = (BLOCK_MAJOR, HEAD_MAJOR, LAYER_MAJOR)
LAYOUT_NAMES = {"block_major": BLOCK_MAJOR, "head_major": HEAD_MAJOR, "layer_major": LAYER_MAJOR}
"""EngineConfig.kv_layout's explicit choices → the layout they build."""

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
FP8_KV_DTYPE = "float8_e4m3fn"


def torch_dtype(name: str) -> torch.dtype:
    """Map a dtype name ("bfloat16", "float16", "float32") to torch."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape and type of a KV pool; equal specs (and model) are transfer-compatible."""

    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layout: str = KV_LAYOUT
    scales: tuple[float, ...] = ()
    """An e4m3 pool's per-layer scales (k0, v0, k1, v1, ...): stored value = K / k_scale.
    Empty for a pool in the model's float dtype."""
    tp_size: int = 1
    """Tensor-parallel ranks of the worker; the pool holds rank `tp_rank`'s KV heads."""
    tp_rank: int = 0
    model_kv_heads: int = 0
    """The model's KV heads (over every rank); 0: `num_kv_heads` (one rank holds them all)."""
    pp_size: int = 1
    """Pipeline stages of the worker; the pool holds stage `pp_rank`'s layers
    [layer_start, layer_start + num_layers) of the model's `total_layers`
    (vocabulary/pipeline.py cuts them)."""
    pp_rank: int = 0
    layer_start: int = 0
    model_layers: int = 0
    """The model's layers (over every stage); 0: `num_layers` (one stage holds them all)."""
    weights: str = "none"
    """The weight format of the model whose K and V the pool holds (`LlamaModel.quantization`:
    none, fp8, int8, int4): pools of models that compute different numbers do not exchange
    blocks (part of the hand-off's compatibility hash)."""

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KV pool of TP rank {self.tp_rank} of size {self.tp_size}")
        if self.pp_size < 1 or not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"KV pool of pipeline stage {self.pp_rank} of {self.pp_size}")
        if (
            self.layer_start < 0
            or self.layer_start + self.num_layers > self.total_layers
            or (self.pp_size == 1 and self.total_layers != self.num_layers)
        ):
            raise ValueError(
                f"KV pool of {self.pp_size} stage(s) holding layers [{self.layer_start}, "
                f"{self.layer_start + self.num_layers}) of a model with {self.total_layers}"
            )
        if self.layout not in KV_LAYOUTS:
            raise ValueError(f"KV layout {self.layout!r}: one of {', '.join(KV_LAYOUTS)}")
        one_rank_short = self.tp_size == 1 and self.total_kv_heads != self.num_kv_heads
        if self.model_kv_heads < 0 or one_rank_short:
            raise ValueError(
                f"KV pool of {self.tp_size} rank(s) holding {self.num_kv_heads} KV heads "
                f"of a model with {self.model_kv_heads}"
            )
        quantized = self.dtype == FP8_KV_DTYPE
        if quantized != bool(self.scales) or (
            quantized and len(self.scales) != 2 * self.num_layers
        ):
            raise ValueError(
                f"KV pool of {self.dtype} needs {2 * self.num_layers if quantized else 0} "
                f"scales, got {len(self.scales)}"
            )

    def layer_scales(self, layer: int) -> tuple[float, float]:
        """(k_scale, v_scale) of one layer; (1.0, 1.0) for a float pool."""
        if not self.scales:
            return 1.0, 1.0
        return self.scales[2 * layer], self.scales[2 * layer + 1]

    @property
    def total_layers(self) -> int:
        """The model's layers (this pool holds `num_layers` of them from `layer_start`)."""
        return self.model_layers or self.num_layers

    @property
    def total_kv_heads(self) -> int:
        """The model's KV heads (this pool holds `num_kv_heads` of them)."""
        return self.model_kv_heads or self.num_kv_heads

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """The pool tensor's shape (module docstring)."""
        n, layers, page, heads, dim = (
            self.num_blocks, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim
        )  # fmt: skip
        if self.layout == HEAD_MAJOR:
            return (n, heads, layers, 2, page, dim)
        if self.layout == LAYER_MAJOR:
            return (layers, n, 2, page, heads, dim)
        return (n, layers, 2, page, heads, dim)

    @property
    def block_dim(self) -> int:
        """The tensor dimension block ids index (1 for layer-major, else 0)."""
        return 1 if self.layout == LAYER_MAJOR else 0

    @property
    def num_segments(self) -> int:
        """Contiguous pieces of one block: a layer-major block has one per layer."""
        return self.num_layers if self.layout == LAYER_MAJOR else 1

    @property
    def segment_nbytes(self) -> int:
        """Bytes of one contiguous piece of a block (the whole block when block-first)."""
        return self.block_nbytes // self.num_segments

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=torch_dtype(self.dtype)).element_size()

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block (all layers, K and V)."""
        return (
            self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        ) * self.element_size

    @property
    def head_nbytes(self) -> int:
        """Bytes of one KV head's part of a block (all layers, K and V): in a head-major
        block, head h is the region [h * head_nbytes, (h + 1) * head_nbytes)."""
        return self.block_nbytes // self.num_kv_heads

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes


def block_segments(tensor: torch.Tensor, block_dim: int) -> torch.Tensor:
    """A contiguous KV tensor (a pool, or a tier's tensor in the pool's layout) whose block ids
    index dimension `block_dim` (`KVCacheSpec.block_dim`), viewed as [segments, blocks, one
    segment's elements]: the dimensions before `block_dim` number a block's contiguous pieces
    (one when there are none), those after it make one piece. A run of blocks of one segment
    is a contiguous slice (engine/kv/host_tier.py copies them; kv_transfer/backend.py
    `kv_region` describes them to NIXL)."""
    return tensor.view(math.prod(tensor.shape[:block_dim]), tensor.shape[block_dim], -1)


class KVCache:
    """The KV tensor of one worker. Block ids index dimension `spec.block_dim` of it.

    The tensor never moves or grows after construction, so its address can be registered
    with a transfer library once (kv_transfer registers `tensor`).
    """

    def __init__(self, spec: KVCacheSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.tensor = torch.zeros(spec.shape, dtype=torch_dtype(spec.dtype), device=self.device)

    def layer(self, layer: int) -> torch.Tensor:
        """Per-layer strided view [num_blocks, 2, block_size, kv_heads, head_dim], whatever
        the layout (writes through it land in the pool)."""
        if self.spec.layout == HEAD_MAJOR:  # [blocks, heads, 2, page, dim] → NHD order
            return self.tensor[:, :, layer].permute(0, 2, 3, 1, 4)
        if self.spec.layout == LAYER_MAJOR:
            return self.tensor[layer]
        return self.tensor[:, layer]

    def copy_blocks_from(
        self, src: KVCache, src_block_ids: list[int], dst_block_ids: list[int]
    ) -> None:
        """Copy whole blocks from another cache (an in-process hand-off, for tests)."""
        a, b = src.spec, self.spec
        same = (a.dtype, a.scales, a.tp_size, a.layout, a.weights) == (
            b.dtype, b.scales, b.tp_size, b.layout, b.weights
        )  # fmt: skip
        dim = self.spec.block_dim
        src_shape, shape = list(src.spec.shape), list(self.spec.shape)
        del src_shape[dim], shape[dim]
        if src_shape != shape or not same:
            raise ValueError(f"incompatible KV caches: {src.spec} vs {self.spec}")
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError("src and dst block lists differ in length")
        src_idx = torch.tensor(src_block_ids, dtype=torch.long, device=src.device)
        dst_idx = torch.tensor(dst_block_ids, dtype=torch.long, device=self.device)
        moved = src.tensor.index_select(dim, src_idx).to(self.device)
        self.tensor.index_copy_(dim, dst_idx, moved)
