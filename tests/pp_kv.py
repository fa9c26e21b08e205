"""TEST-ONLY: a model's KV whose every value says where it is (block, layer, K/V, token, head,
dim), and the pool of one rank of a pipeline x tensor-parallel worker holding its part of it
(its stage's layers, its TP rank's heads) in any layout of engine/kv/kv_cache.py. The hand-off
tests (unit over the loopback backend, integration over NIXL) fill prefill ranks with it and
check that every decode rank ends with exactly its part."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv.kv_cache import HEAD_MAJOR, LAYER_MAJOR, KVCacheSpec
from kv_transfer.tp_plan import kv_heads_of


def model_kv(blocks: int, layers: int, page: int, heads: int, dim: int) -> torch.Tensor:
    """[blocks, layers, 2, page, heads, dim] float32, every value distinct (its own index)."""
    n = blocks * layers * 2 * page * heads * dim
    assert n < 2**24, "float32 counts exactly only up to 2**24"
    return torch.arange(n, dtype=torch.float32).reshape(blocks, layers, 2, page, heads, dim)


def rank_spec(
    kv: torch.Tensor,
    layout: str,
    bounds: Sequence[int],
    tp: int,
    rank: int,
    dtype: str = "float32",
) -> KVCacheSpec:
    """The pool spec of worker rank `rank` (stage-major: stage rank // tp) of a worker of
    stages cut at `bounds` x `tp` ranks, over the model of `kv`."""
    blocks, layers, _, page, heads, dim = kv.shape
    stage, tp_rank = divmod(rank, tp)
    pp = len(bounds) - 1
    return KVCacheSpec(
        blocks, bounds[stage + 1] - bounds[stage], page, len(kv_heads_of(heads, tp, tp_rank)),
        dim, dtype, layout=layout, tp_size=tp, tp_rank=tp_rank,
        model_kv_heads=heads if tp > 1 else 0, pp_size=pp, pp_rank=stage,
        layer_start=bounds[stage], model_layers=layers if pp > 1 else 0,
    )  # fmt: skip


def rank_values(kv: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
    """What the pool of `spec` holds of the model's `kv`, in its layout (`spec.shape`)."""
    heads = kv_heads_of(spec.total_kv_heads, spec.tp_size, spec.tp_rank)
    layers = slice(spec.layer_start, spec.layer_start + spec.num_layers)
    part = kv[:, layers, :, :, heads.start : heads.stop]  # [blocks, layers, 2, page, heads, dim]
    if spec.layout == HEAD_MAJOR:
        part = part.permute(0, 4, 1, 2, 3, 5)
    elif spec.layout == LAYER_MAJOR:
        part = part.permute(1, 0, 2, 3, 4, 5)
    return part.contiguous()


def blocks_of(tensor: torch.Tensor, spec: KVCacheSpec, block_ids: Sequence[int]) -> torch.Tensor:
    """Blocks `block_ids` of a pool (or of `rank_values`) of `spec`, block ids first."""
    return tensor.movedim(spec.block_dim, 0)[list(block_ids)]
