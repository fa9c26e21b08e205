"""How many KV blocks a worker's pool gets.

CPU: `EngineConfig.num_kv_blocks`, or 4096 blocks. GPU: the configured number, or
kv_cache_memory_fraction * (free memory after the weights are loaded - the activation peak of
the largest step), divided by the bytes of one block. The activation peak is measured by
running the loaded model once on `max_num_batched_tokens` tokens (dense causal attention, no
cache) plus logits for `max_num_seqs` rows; CUDA graphs and attention workspaces live in the
remaining (1 - fraction) share.
"""

from __future__ import annotations

import os

import torch

from engine.config import EngineConfig
from engine.kv.kv_cache import KV_LAYOUT, LAYER_MAJOR, LAYOUT_NAMES, KVCacheSpec, dtype_name
from engine.modeling.llama import LlamaModel, causal_attend
from engine.tp.tp_shard import TPShard
from vocabulary.model_config import ModelConfig
from vocabulary.numeric import cdiv

CPU_DEFAULT_KV_BLOCKS = 4096


def kv_cache_spec(
    model_cfg: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    num_blocks: int,
    scales: tuple[float, ...] = (),
    shard: TPShard | None = None,
    layout: str = KV_LAYOUT,
    model_kv_heads: int = 0,
) -> KVCacheSpec:
    """The pool spec of this model at this block size and dtype (an e4m3 pool: with its
    per-layer scales, engine/loading/fp8_calibration.py); a TP rank's pool with `shard` (then
    `model_cfg` is the rank's part, engine/tp/tp_shard.py `local_config`, and `model_kv_heads`
    the whole model's KV heads); `layout`: engine/kv/kv_cache.py's."""
    tp = shard or TPShard(1, 0)
    return KVCacheSpec(
        num_blocks=num_blocks,
        num_layers=model_cfg.num_layers,
        block_size=block_size,
        num_kv_heads=model_cfg.num_kv_heads,
        head_dim=model_cfg.head_dim,
        dtype=dtype_name(dtype),
        scales=scales,
        tp_size=tp.size,
        tp_rank=tp.rank,
        layout=layout,
        model_kv_heads=model_kv_heads if tp.size > 1 else 0,
    )


def kv_layout(config: EngineConfig, device: torch.device | None = None) -> str:
    """The pool layout `config.kv_layout` asks for. auto: layer-major on a GPU (attention over
    one layer stays within the TLB's reach: the 70B shape's B=64 decode step 4% faster on an
    H100, the same on an H200; engine/kv/kv_cache.py; docs/benchmarks.md, "FP8 weights and
    e4m3 KV"), block-major elsewhere. A cluster resolves
    auto itself where its workers hand KV to each other (deploy/control/cluster_spec.py)."""
    if config.kv_layout == "auto":
        return LAYER_MAJOR if device is not None and device.type == "cuda" else KV_LAYOUT
    return LAYOUT_NAMES[config.kv_layout]


@torch.inference_mode()
def profile_activation_peak(model: LlamaModel, num_tokens: int, num_logit_rows: int) -> int:
    """Bytes a forward of num_tokens (one sequence) plus its logits adds on the GPU at peak."""
    device = model.device
    cfg = model.cfg
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    attend = causal_attend(1, num_tokens, cfg.num_heads, cfg.num_kv_heads)
    hidden = model(ids, positions, attend)
    model.compute_logits(hidden[:num_logit_rows])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del hidden
    torch.cuda.empty_cache()
    return int(peak)


def decide_num_kv_blocks(
    config: EngineConfig,
    model_cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    model: LlamaModel | None = None,
    scales: tuple[float, ...] = (),
) -> int:
    """Number of KV blocks for the pool (see the module docstring); `dtype` and `scales`: the
    pool's (an e4m3 pool's per-layer scales, `kv_cache_spec`).

    On GPU without a configured number, `model` (already loaded on `device`) is required.
    Raises ValueError when the memory left cannot hold one sequence of max_model_len tokens.
    """
    if config.num_kv_blocks > 0:
        return config.num_kv_blocks
    if device.type != "cuda":
        return CPU_DEFAULT_KV_BLOCKS
    if model is None:
        raise ValueError("sizing the KV pool on GPU needs the loaded model (to profile it)")
    block_bytes = kv_cache_spec(model_cfg, config.block_size, dtype, 1, scales).block_nbytes
    tokens = config.max_num_batched_tokens
    peak = profile_activation_peak(model, tokens, min(config.max_num_seqs, tokens))
    free, _total = torch.cuda.mem_get_info(device)
    budget = config.kv_cache_memory_fraction * (free - peak)
    num_blocks = int(budget // block_bytes)
    max_len = config.max_model_len or model_cfg.max_model_len
    needed = cdiv(max_len, config.block_size)
    if num_blocks < needed:
        raise ValueError(
            f"KV pool of {num_blocks} blocks ({budget / 2**30:.2f} GiB free for KV after "
            f"weights and a {peak / 2**30:.2f} GiB activation peak) cannot hold one "
            f"{max_len}-token sequence ({needed} blocks); lower max_model_len or "
            "max_num_batched_tokens, or raise kv_cache_memory_fraction"
        )
    return num_blocks


HOST_KV_AUTO_FRACTION = 0.1
HOST_KV_AUTO_MAX_GIB = 64.0
HOST_KV_AUTO_MAX_POOLS = 8


def host_available_bytes() -> int:
    """RAM the host can give without swapping (MemAvailable: free plus reclaimable cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def decide_num_host_blocks(config: EngineConfig, block_nbytes: int, num_device_blocks: int) -> int:
    """Blocks of the host tier (EngineConfig.host_kv_gb; 0: no tier, and always with tensor
    parallelism, which does not mirror the tier's copies on the follower ranks yet)."""
    if config.host_kv_gb == 0 or not config.enable_prefix_caching:
        return 0
    if config.tensor_parallel_size > 1:
        return 0
    if config.host_kv_gb > 0:
        return max(1, int(config.host_kv_gb * 2**30 // block_nbytes))
    available = host_available_bytes()
    nbytes = min(HOST_KV_AUTO_FRACTION * available, HOST_KV_AUTO_MAX_GIB * 2**30)
    return max(0, min(int(nbytes // block_nbytes), HOST_KV_AUTO_MAX_POOLS * num_device_blocks))
