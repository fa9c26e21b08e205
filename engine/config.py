"""Engine configuration: one frozen dataclass, each field documented (it becomes CLI help)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EngineMode(enum.Enum):
    """What an engine instance does with a request.

    PREFILL_ONLY: compute the prompt, sample the first token, stop, and keep the blocks (the
        worker hands them off to a decode worker and frees them when the lease ends).
    DECODE_ONLY: sequences arrive with their prompt KV already in the cache (pulled from a
        prefill worker) plus the first token, and are decoded to completion.
    COLOCATED: both, in one engine (chunked prefill mixed with decodes).
    """

    PREFILL_ONLY = "prefill_only"
    DECODE_ONLY = "decode_only"
    COLOCATED = "colocated"


QUANTIZATIONS = ("none", "fp8")
"""Choices of EngineConfig.quantization."""
KV_CACHE_DTYPES = ("auto", "fp8")
"""Choices of EngineConfig.kv_cache_dtype."""
LOAD_FORMATS = ("auto", "dummy")
"""Choices of EngineConfig.load_format."""


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine (one worker's model, KV pool, scheduler and sampler)."""

    model_dir: str
    """Hugging Face checkpoint folder on local disk (config.json, *.safetensors, tokenizer)."""
    model_id: str = ""
    """Name binding prefix-cache hashes and the transfer handshake (default: the folder name)."""
    mode: EngineMode = EngineMode.COLOCATED
    """Prefill-only, decode-only or colocated (see EngineMode)."""
    dtype: str = "auto"
    """Weights/KV dtype: auto (bfloat16 on GPU, float32 on CPU), bfloat16, float16, float32."""
    quantization: str = "none"
    """Weights of the decoder projections: none (the dtype above) or fp8 (e4m3, one scale per
    tensor, quantized at load; activations quantized at run time; embeddings, norms and the
    head stay in the dtype above). GPU: cuBLASLt FP8 GEMMs (Hopper); CPU: dequantized.
    A pre-quantized FP8 checkpoint (compressed-tensors float-quantized) loads as FP8 whatever
    this says: the checkpoint decides."""
    kv_cache_dtype: str = "auto"
    """KV pool element type: auto (the dtype above) or fp8 (e4m3 with one static scale per
    layer for K and one for V, calibrated at load; halves KV bytes per block and per
    hand-off). Prefill and decode workers must agree (the transfer handshake refuses)."""
    load_format: str = "auto"
    """auto (the checkpoint's safetensors) or dummy (random weights made on the device from
    config.json alone, for measuring shapes whose checkpoint is not on disk; seeded by `seed`;
    with fp8 made layer by layer straight into FP8, so a model whose bf16 weights would not
    fit the device loads when its FP8 weights do)."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:N."""
    block_size: int = 16
    """Tokens per KV block (page)."""
    num_kv_blocks: int = 0
    """KV blocks in the pool; 0 = size from kv_cache_memory_fraction (GPU) or 4096 blocks (CPU)."""
    kv_cache_memory_fraction: float = 0.85
    """GPU: fraction of free memory (after weights and activations) given to the KV pool."""
    max_num_seqs: int = 256
    """Most sequences in the running batch."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes)."""
    enable_chunked_prefill: bool = True
    """Split long prompts into chunks that fit the step's token budget."""
    enable_prefix_caching: bool = True
    """Reuse cached full blocks of earlier prompts with the same hash chain."""
    host_kv_gb: float = -1.0
    """Host-memory KV tier (engine/host_tier.py): GiB of host RAM (pinned on GPU) holding prefix
    blocks the device pool evicts, onboarded again on a hit instead of recomputed. -1 = auto
    (a tenth of the host's available RAM, at most 64 GiB and at most 8 times the device pool);
    0 = off. Needs prefix caching."""
    host_kv_max_blocks_per_step: int = 256
    """The host tier's budget per step: blocks copied out (offload) and blocks onboarded at most
    per engine step; more wait for the next step."""
    max_model_len: int = 0
    """Longest prompt + output; 0 = the model's context length."""
    attention_backend: str = "auto"
    """auto (flashinfer on GPU when installed, else torch), torch, flashinfer."""
    layer_ops: str = "auto"
    """Norm / residual / RoPE / SiLU ops of each layer: auto (flashinfer's fused kernels for a
    CUDA fp16/bf16 model when flashinfer imports and they pass a start-up self-check against
    torch, else torch), torch (reference math), flashinfer (fused; an error if unavailable)."""
    cuda_graphs: bool = True
    """Capture decode steps in CUDA graphs (GPU only)."""
    cuda_graph_max_batch: int = 256
    """Largest decode batch captured in a CUDA graph."""
    overlap_scheduling: bool = True
    """Hide host work behind the device: step t+1 is scheduled, staged and queued while step t
    runs, and step t's tokens are read (detokenized, stop-checked) after; sampled ids feed the
    next step's inputs on the device, one host wait per step. Off: each step is read before
    the next is scheduled (same outputs; for comparison)."""
    seed: int = 0
    """Seed of the default sampling generator (requests may carry their own)."""
