"""How many KV blocks a worker's pool gets.

CPU: `EngineConfig.num_kv_blocks`, or 4096 blocks. GPU: the configured number, or
kv_cache_memory_fraction * (free memory after the weights are loaded - the activation peak of
the largest step), divided by the bytes of one block. The activation peak is measured by
running the loaded model once on `max_num_batched_tokens` tokens (dense causal attention, no
cache) plus logits for `max_num_seqs` rows; CUDA graphs and attention workspaces live in the
remaining (1 - fraction) share.

Workers that share one GPU (a prefill and a decode worker on one card, each placed on a
fraction of it) must not each size from what is free when they start: the first would take
most of the card and the second fail to capture its graphs. A worker with
`gpu_memory_share` s < 1 sizes from s * total - what it already holds (its weights) instead,
when that is less, so two workers at 0.5 each fit whichever starts first. A configured number
of blocks is checked against the free memory too: one that cannot fit is refused with the
figures, before the allocation fails deep in torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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
    weights: str = "none",
    stage: tuple[int, int, int, int] = (1, 0, 0, 0),
) -> KVCacheSpec:
    """The pool spec of this model at this block size and dtype (an e4m3 pool: with its
    per-layer scales, engine/loading/fp8_calibration.py); a TP rank's pool with `shard` (then
    `model_cfg` is the rank's part, engine/tp/tp_shard.py `local_config`, and `model_kv_heads`
    the whole model's KV heads); `layout`: engine/kv/kv_cache.py's; `weights`: the model's
    weight format (`LlamaModel.quantization`); `stage`: a pipeline stage's pool, (stages, this
    stage, its first layer, the model's layers), `model_cfg` then being the stage's part."""
    tp = shard or TPShard(1, 0)
    pp_size, pp_rank, layer_start, model_layers = stage
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
        weights=weights,
        pp_size=pp_size,
        pp_rank=pp_rank,
        layer_start=layer_start,
        model_layers=model_layers if pp_size > 1 else 0,
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
    """Bytes a forward of num_tokens (one sequence) plus its logits adds on the GPU at peak
    (a pipeline stage: its layers, and the logits on the last stage only)."""
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
    if model.has_head:  # (a pipeline stage before the last passes its hidden states on)
        model.compute_logits(hidden[:num_logit_rows])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del hidden
    torch.cuda.empty_cache()
    return int(peak)


@dataclass(frozen=True)
class DeviceMemory:
    """What sizing reads of the device, in bytes: free and total (`torch.cuda.mem_get_info`),
    what this worker holds already (`held_bytes`: its weights) and the activation peak of its
    largest step (`profile_activation_peak`)."""

    free: int
    total: int
    held: int
    peak: int

    def describe(self) -> str:
        gib = 2**30
        return (
            f"{self.free / gib:.2f} GiB free of {self.total / gib:.2f} GiB, this worker holding "
            f"{self.held / gib:.2f} GiB and needing {self.peak / gib:.2f} GiB for activations"
        )


def kv_budget_bytes(mem: DeviceMemory, fraction: float, share: float) -> float:
    """Bytes the KV pool may take: `fraction` of what is left after the activation peak, of the
    free memory or (share < 1) of this worker's share of the device less what it holds,
    whichever is less."""
    left: float = mem.free - mem.peak
    if share < 1.0:
        left = min(left, share * mem.total - mem.held - mem.peak)
    return max(0.0, fraction * left)


def check_configured_blocks(num_blocks: int, block_bytes: int, mem: DeviceMemory) -> None:
    """Refuse a configured pool that cannot fit beside the activation peak in the free memory
    (ValueError naming the figures and what fits)."""
    need = num_blocks * block_bytes
    room = mem.free - mem.peak
    if need > room:
        fits = max(0, room) // block_bytes
        raise ValueError(
            f"num_kv_blocks: {num_blocks} blocks need {need / 2**30:.2f} GiB but the device has "
            f"{mem.describe()}: at most {fits} blocks fit (another worker on this GPU holds the "
            "rest?); lower num_kv_blocks, or 0 to size the pool from memory"
        )


def read_device_memory(
    device: torch.device, model: LlamaModel, config: EngineConfig
) -> DeviceMemory:
    """Measure `DeviceMemory` for `model` loaded on `device` under `config`'s step sizes."""
    tokens = config.max_num_batched_tokens
    peak = profile_activation_peak(model, tokens, min(config.max_num_seqs, tokens))
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(free, total, held_bytes(model), peak)


def held_bytes(model: LlamaModel) -> int:
    """Bytes of the model's parameters and buffers (its weights: what the worker holds before
    its pool; per engine, where the process's allocator counts every engine in it)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


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

    On GPU, `model` (already loaded on `device`) is required.
    Raises ValueError when the memory left cannot hold one sequence of max_model_len tokens, or
    a configured number of blocks cannot fit.
    """
    if device.type != "cuda":
        return config.num_kv_blocks or CPU_DEFAULT_KV_BLOCKS
    if model is None:
        raise ValueError("sizing the KV pool on GPU needs the loaded model (to profile it)")
    block_bytes = kv_cache_spec(model_cfg, config.block_size, dtype, 1, scales).block_nbytes
    mem = read_device_memory(device, model, config)
    if config.num_kv_blocks > 0:
        check_configured_blocks(config.num_kv_blocks, block_bytes, mem)
        return config.num_kv_blocks
    budget = kv_budget_bytes(mem, config.kv_cache_memory_fraction, config.gpu_memory_share)
    num_blocks = int(budget // block_bytes)
    max_len = config.max_model_len or model_cfg.max_model_len
    needed = cdiv(max_len, config.block_size)
    if num_blocks < needed:
        share = (
            f" and a {config.gpu_memory_share:g} share of the device"
            if config.gpu_memory_share < 1
            else ""
        )
        raise ValueError(
            f"KV pool of {num_blocks} blocks ({budget / 2**30:.2f} GiB for KV; {mem.describe()}"
            f"{share}) cannot hold one {max_len}-token sequence ({needed} blocks); lower "
            "max_model_len or max_num_batched_tokens, or raise kv_cache_memory_fraction"
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
    parallelism, which does not mirror the tier's copies on the other ranks yet).
    `block_nbytes`: a block of the whole model (a pipeline stage holds its layers' part of
    it: the worker's stages together hold host_kv_gb)."""
    if config.host_kv_gb == 0 or not config.enable_prefix_caching:
        return 0
    if config.tensor_parallel_size > 1:
        return 0
    if config.host_kv_gb > 0:
        return max(1, int(config.host_kv_gb * 2**30 // block_nbytes))
    available = host_available_bytes()
    nbytes = min(HOST_KV_AUTO_FRACTION * available, HOST_KV_AUTO_MAX_GIB * 2**30)
    return max(0, min(int(nbytes // block_nbytes), HOST_KV_AUTO_MAX_POOLS * num_device_blocks))
