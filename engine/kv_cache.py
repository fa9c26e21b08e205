"""The paged KV memory of one worker: allocated once, addressable per block.

Layout (`block_major_v1`): one tensor of shape
    [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]
so a block holds every layer's K and V contiguously. Why: NIXL has a fixed cost per
descriptor and moves small descriptors far below the link rate (one page of one layer of
Llama-3-8B is 64 KiB); block-major makes one block one descriptor (2 MiB for Llama-3-8B at
block size 16), and adjacent blocks coalesce further. Attention kernels take the strided
per-layer view `tensor[:, layer]` ([num_blocks, 2, block_size, kv_heads, head_dim],
flashinfer's NHD paged layout) at no cost. Both measured on the H200: docs/benchmarks.md
("GPU: KV transfer", "GPU: engine").

Tensor parallelism (engine/tp_shard.py): each rank has a pool of its own holding only its KV
heads (`num_kv_heads` is the rank's count), with the same block ids on every rank. The TP
size is part of what a block means, so it enters the transfer handshake's compatibility
fields (kv_transfer/types.py): a hand-off between different TP layouts is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_LAYOUT = "block_major_v1"

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

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KV pool of TP rank {self.tp_rank} of size {self.tp_size}")
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
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (
            self.num_blocks,
            self.num_layers,
            2,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )

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
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes


class KVCache:
    """The KV tensor of one worker. Block ids index its first dimension.

    The tensor never moves or grows after construction, so its address can be registered
    with a transfer library once (kv_transfer registers `tensor`).
    """

    def __init__(self, spec: KVCacheSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.tensor = torch.zeros(spec.shape, dtype=torch_dtype(spec.dtype), device=self.device)

    def layer(self, layer: int) -> torch.Tensor:
        """Per-layer strided view [num_blocks, 2, block_size, kv_heads, head_dim]."""
        return self.tensor[:, layer]

    def copy_blocks_from(
        self, src: KVCache, src_block_ids: list[int], dst_block_ids: list[int]
    ) -> None:
        """Copy whole blocks from another cache (an in-process hand-off, for tests)."""
        same = (src.spec.dtype, src.spec.scales, src.spec.tp_size) == (
            self.spec.dtype, self.spec.scales, self.spec.tp_size
        )  # fmt: skip
        if src.spec.shape[1:] != self.spec.shape[1:] or not same:
            raise ValueError(f"incompatible KV caches: {src.spec} vs {self.spec}")
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError("src and dst block lists differ in length")
        src_idx = torch.tensor(src_block_ids, dtype=torch.long, device=src.device)
        dst_idx = torch.tensor(dst_block_ids, dtype=torch.long, device=self.device)
        self.tensor[dst_idx] = src.tensor[src_idx].to(self.device)
