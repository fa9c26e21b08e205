"""Engine configuration: one frozen dataclass, each field documented (it becomes CLI help)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vocabulary.lora_names import check_lora_name

PIPELINE_SCHEDULES = ("cross_step", "within_step")
"""`EngineConfig.pipeline_schedule`'s values."""


class EngineMode(enum.Enum):
    """What an engine instance does with a request.

    PREFILL_ONLY: compute the prompt, sample the first token, stop, and keep the blocks (the
        worker hands them off to a decode worker and frees them when the lease ends).
    DECODE_ONLY: sequences arrive with their prompt KV already in the cache (pulled from a
        prefill worker) plus the first token, and are decoded to completion.
    COLOCATED: both, in one engine (chunked prefill mixed with decodes).
    SPLIT: both, in two loops over one KV pool (engine/core/prefill_lane.py): prompts are
        prefilled on a prefill loop and handed to the decode loop by a change of block
        ownership; on a GPU each loop runs in a partition of the SMs of its own.
    """

    PREFILL_ONLY = "prefill_only"
    DECODE_ONLY = "decode_only"
    COLOCATED = "colocated"
    SPLIT = "split"


QUANTIZATIONS = ("none", "fp8")
"""Choices of EngineConfig.quantization."""
KV_CACHE_DTYPES = ("auto", "fp8")
"""Choices of EngineConfig.kv_cache_dtype."""
FP8_ACTIVATION_SCALES = ("checkpoint", "calibrated")
"""Choices of EngineConfig.fp8_activation_scales."""
KV_LAYOUT_CHOICES = ("auto", "block_major", "head_major", "layer_major")
"""Choices of EngineConfig.kv_layout (engine/kv/kv_cache.py describes the layouts)."""
LOAD_FORMATS = ("auto", "dummy")
"""Choices of EngineConfig.load_format."""
DECODE_ATTENTION_CHOICES = ("auto", "flashinfer", "triton", "triton-e4m3-scores", "xqa")
"""Choices of EngineConfig.decode_attention."""
LORA_KERNELS = ("auto", "torch", "flashinfer", "triton")
"""Choices of EngineConfig.lora_kernel: the CUDA-graph LoRA kernel (eager steps always run
grouped; engine/lora/lora_apply.py)."""


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
    tensor, quantized at load; activations with one static scale per projection, calibrated
    at load; embeddings, norms and the head stay in the dtype above). GPU: cuBLASLt FP8
    GEMMs (Hopper); CPU: dequantized. A pre-quantized FP8 checkpoint (compressed-tensors
    float-quantized) loads as FP8 whatever this says, computed as it declares
    (fp8_activation_scales), and an INT8 W8A8 or INT4 W4A16 one (int-quantized,
    pack-quantized) as INT: the checkpoint decides."""
    fp8_activation_scales: str = "checkpoint"
    """How FP8 projections scale their inputs: checkpoint (what a pre-quantized checkpoint
    declares: dynamic per token, dynamic per tensor, or its static scales; pdserve's own FP8,
    quantization=fp8 on a dense checkpoint, calibrates one static scale per projection at
    load) or calibrated (opt-in: every projection without a static scale in its checkpoint
    gets one calibrated at load, so the op before it writes e4m3 itself, faster on the GPU,
    but one scale shared by every request instead of the checkpoint's per-token ones)."""
    kv_cache_dtype: str = "auto"
    """KV pool element type: auto (the dtype above) or fp8 (e4m3 with one static scale per
    layer for K and one for V, calibrated at load; halves KV bytes per block and per
    hand-off). Prefill and decode workers must agree (the transfer handshake refuses)."""
    kv_layout: str = "auto"
    """KV pool layout (engine/kv/kv_cache.py): block_major (every layer's K and V of all heads
    per token; a block and runs of blocks are one transfer descriptor), head_major (each KV
    head's layers contiguous: a decode rank of another tensor-parallel size reads just its
    heads, one descriptor per block), layer_major (each layer's pages together: attention
    stays within the GPU's TLB reach, a hand-off moves a descriptor per layer), or auto
    (layer_major on a GPU, block_major elsewhere: engine/kv/kv_sizing.py; a disaggregated
    cluster resolves it to block_major, or head_major for every worker when prefill and
    decode TP sizes differ: deploy/control/cluster_spec.py). Prefill and decode workers must agree
    (the transfer handshake refuses)."""
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
    gpu_memory_share: float = 1.0
    """GPU: the share of the device's memory this worker may hold in all (weights, activations,
    KV, graphs), for workers that share one GPU (0 < share <= 1). A worker actor placed on a
    fraction of a GPU gets that fraction unless this is set below 1 (engine/kv/kv_sizing.py)."""
    max_num_seqs: int = 256
    """Most sequences in the running batch."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes)."""
    enable_chunked_prefill: bool = True
    """Split long prompts into chunks that fit the step's token budget."""
    enable_prefix_caching: bool = True
    """Reuse cached full blocks of earlier prompts with the same hash chain."""
    host_kv_gb: float = -1.0
    """Host-memory KV tier (engine/kv/host_tier.py): GiB of host RAM (pinned on GPU) holding prefix
    blocks the device pool evicts, onboarded again on a hit instead of recomputed. -1 = auto
    (a tenth of the host's available RAM, at most 64 GiB and at most 8 times the device pool);
    0 = off. Needs prefix caching. A pipeline worker's stages hold it together, each its
    layers' part of every block."""
    host_kv_max_blocks_per_step: int = 256
    """The host tier's budget per step: blocks copied out (offload) and blocks onboarded at most
    per engine step; more wait for the next step."""
    host_kv_handoff: bool = True
    """A prefill-only worker hands off a prompt's blocks that its host tier also holds from
    there (the decode worker reads them from pinned host memory over NIXL) and gives their
    device blocks back to its pool at once; off: every block is handed off from the device
    (always on a pipeline worker, whose other stages do not register their host blocks; and
    in a cluster with a worker of several ranks, TP or PP, whose hand-offs read KV pools
    only: deploy/control/cluster_spec.py `ClusterSpec.host_kv_handoff`)."""
    max_model_len: int = 0
    """Longest prompt + output; 0 = the model's context length."""
    attention_backend: str = "auto"
    """auto (flashinfer on GPU when installed, else torch), torch, flashinfer."""
    decode_attention: str = "auto"
    """The flashinfer backend's single-token decode kernel: auto (for an e4m3 KV pool
    flashinfer's XQA on SM90 where it builds, else the Triton split-KV kernel of
    engine/attention/triton_decode.py, both nearer their KV-read floor than flashinfer's
    decode (docs/benchmarks.md, "Decode attention kernels"); flashinfer's tensor-core decode
    for a float pool),
    flashinfer, triton, triton-e4m3-scores (an e4m3 pool only: the Triton kernel with q
    rounded to e4m3 per head so the scores' dot reads K as stored, `DecodeTiles.scores_fp8`),
    xqa (flashinfer's XQA, TensorRT-LLM's GQA decode: on Hopper over an e4m3 pool a TMA +
    warpgroup-MMA kernel with q in e4m3; engine/attention/xqa_decode.py)."""
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
    grammar_cache_size: int = 256
    """Compiled structured-output constraints kept (LRU, engine/structured/grammars.py):
    requests with a schema, regex or grammar seen before skip the compile."""
    grammar_compile_timeout_s: float = 10.0
    """A constraint that has not compiled within this is refused (INVALID_ARGUMENT naming
    structured_output); its compile goes on beside, and a later request may find it done."""
    enable_lora: bool = False
    """Serve LoRA adapters (engine/lora/lora_cache.py): requests name one in `lora_name`, and
    adapters are registered at run time (`LLMEngine.load_lora`). On with any `loras`."""
    max_loras: int = 4
    """LoRA device slots: the most distinct adapters one step mixes (more wait for a slot)."""
    max_cpu_loras: int = 8
    """LoRA adapters kept in host memory (LRU) so that a slot is refilled without a disk
    read; at least max_loras."""
    max_lora_rank: int = 64
    """Largest LoRA rank served (a higher one is refused at registration); every slot is
    sized for it."""
    lora_kernel: str = "auto"
    """LoRA kernel of CUDA-graph decode steps: auto (triton where it runs and passes its
    self-check, else torch), torch (dense over the slots), flashinfer, triton."""
    loras: tuple[tuple[str, str], ...] = ()
    """(name, path) of the LoRA adapters registered at start (PEFT folders on local disk);
    any turns LoRA on. A name is 1 to 128 characters of A-Z a-z 0-9 . _ - : / + = @ ~ and
    is given once; a folder the engine cannot serve fails start-up, naming it."""
    tensor_parallel_size: int = 1
    """Ranks (devices) one engine's model is split over, Megatron-style (engine/tp/tp_shard.py):
    rank 0 runs this engine (scheduler, sampler), the others follow it step by step
    (engine/core/tp_runner.py). Must divide the attention heads and the intermediate size, and
    divide the KV heads or be a multiple of them. Not with LoRA; the host KV tier is off."""
    split_decode_sms: int = 0
    """A split engine (mode split): SMs of the decode loop's partition, the prefill loop
    getting the rest; 0: adaptive (vocabulary/split_policy.py: the fewest SMs whose predicted
    decode step meets split_tpot_target_ms, every SM to the side that has work when the
    other is idle). The driver may grant fewer than asked (status shows what it did)."""
    split_tpot_target_ms: float = 20.0
    """A split engine, adaptive: the decode step time the decode partition is sized for."""
    split_resize_interval_s: float = 1.0
    """A split engine, adaptive: the least time between two changes of the split."""
    split_decode_headroom_blocks: int = 8
    """A split engine: blocks the prefill loop leaves free beyond one per running decode
    request, so the decode loop can grow without waiting for a prefill step."""
    tp_timeout_s: float = 60.0
    """Tensor and pipeline parallelism: the deadline of every wait on another rank (a step's
    message, its all-reduces, the ranks' agreement that it ran, a stage's activations); a rank
    that misses it fails the step on every rank and breaks the group (the worker must be
    replaced)."""
    pipeline_parallel_size: int = 1
    """Stages one engine's model is cut into, layers [a_s, b_s) on stage s
    (vocabulary/pipeline.py), each stage `tensor_parallel_size` ranks: a worker is
    pipeline_parallel_size x tensor_parallel_size ranks, rank stage * tensor_parallel_size + TP
    rank. Rank 0 runs this engine (scheduler, sampler); every step's batch flows through the
    stages in micro-batches and the last stage samples (engine/core/pp_runner.py). Must
    divide the layers unless pipeline_layer_partition is given. FP8 and INT weights, an e4m3
    KV pool, LoRA and the host KV tier work per stage (each stage holds its layers' scales,
    adapter weights and host blocks; rank 0 decides for all); not with a split engine."""
    pipeline_layer_partition: tuple[int, ...] = ()
    """Layers of each pipeline stage (pipeline_parallel_size counts summing to the model's
    layers); empty: equal stages."""
    pipeline_micro_batches: int = 0
    """Micro-batches one step's batch is cut into (engine/pp/micro_batches.py: by tokens, a
    long prompt chunk cut too); 0: twice pipeline_parallel_size (within_step) or
    pipeline_parallel_size (cross_step, which also keeps that many decode groups in flight)."""
    pipeline_schedule: str = "cross_step"
    """How a pipeline keeps its stages busy: cross_step (decode requests in groups, each
    group's step in flight on the stages while the others' run: engine/core/decode_groups.py;
    needs overlap_scheduling, else within_step runs) or within_step (one step at a time, its
    batch cut into micro-batches: GPipe within the step, engine/core/pp_runner.py)."""

    def __post_init__(self) -> None:
        if self.grammar_cache_size < 1:
            raise ValueError(f"grammar_cache_size: must be >= 1, got {self.grammar_cache_size}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(
                f"grammar_compile_timeout_s: must be > 0, got {self.grammar_compile_timeout_s}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1:
            if self.lora_enabled:
                raise ValueError(
                    "tensor_parallel_size: LoRA with tensor parallelism is not supported yet "
                    f"(tensor_parallel_size={self.tensor_parallel_size} with enable_lora or "
                    "loras)"
                )
            if self.host_kv_gb > 0:
                raise ValueError(
                    "host_kv_gb: the host KV tier with tensor parallelism is not supported yet "
                    f"(tensor_parallel_size={self.tensor_parallel_size}); use 0 or -1 (off)"
                )
        self._check_pipeline()
        if self.mode is EngineMode.SPLIT and self.tensor_parallel_size > 1:
            raise ValueError(
                "mode: a split engine with tensor parallelism is not supported yet "
                f"(tensor_parallel_size={self.tensor_parallel_size})"
            )
        if self.split_tpot_target_ms <= 0 or self.split_resize_interval_s < 0:
            raise ValueError(
                "split_tpot_target_ms must be > 0 and split_resize_interval_s >= 0, got "
                f"{self.split_tpot_target_ms} and {self.split_resize_interval_s}"
            )
        if self.split_decode_sms < 0 or self.split_decode_headroom_blocks < 0:
            raise ValueError(
                "split_decode_sms and split_decode_headroom_blocks: must be >= 0, got "
                f"{self.split_decode_sms} and {self.split_decode_headroom_blocks}"
            )
        if not 0 < self.kv_cache_memory_fraction <= 1 or not 0 < self.gpu_memory_share <= 1:
            raise ValueError(
                "kv_cache_memory_fraction and gpu_memory_share: each must be in (0, 1], got "
                f"{self.kv_cache_memory_fraction} and {self.gpu_memory_share}"
            )
        if self.fp8_activation_scales not in FP8_ACTIVATION_SCALES:
            choices = ", ".join(FP8_ACTIVATION_SCALES)
            raise ValueError(
                f"fp8_activation_scales: one of {choices}, got {self.fp8_activation_scales!r}"
            )
        if self.kv_layout not in KV_LAYOUT_CHOICES:
            choices = ", ".join(KV_LAYOUT_CHOICES)
            raise ValueError(f"kv_layout: one of {choices}, got {self.kv_layout!r}")
        if self.tp_timeout_s <= 0:
            raise ValueError(f"tp_timeout_s: must be > 0, got {self.tp_timeout_s}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {self.max_loras}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras: must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}"
            )
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank: must be >= 1, got {self.max_lora_rank}")
        if self.decode_attention not in DECODE_ATTENTION_CHOICES:
            choices = ", ".join(DECODE_ATTENTION_CHOICES)
            raise ValueError(f"decode_attention: one of {choices}, got {self.decode_attention!r}")
        if self.lora_kernel not in LORA_KERNELS:
            choices = ", ".join(LORA_KERNELS)
            raise ValueError(f"lora_kernel: one of {choices}, got {self.lora_kernel!r}")
        seen: set[str] = set()
        for pair in self.loras:
            if len(pair) != 2 or not all(isinstance(v, str) for v in pair):
                raise ValueError(f"loras: each entry is (name, path), got {pair!r}")
            name, path = pair
            check_lora_name(name)
            if name in seen:
                raise ValueError(f"loras: adapter {name!r} is given twice")
            if not path:
                raise ValueError(f"loras: adapter {name!r} has no path")
            seen.add(name)

    def _check_pipeline(self) -> None:
        size = self.pipeline_parallel_size
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(
                f"pipeline_schedule: one of {', '.join(PIPELINE_SCHEDULES)}, got "
                f"{self.pipeline_schedule!r}"
            )
        if size < 1 or self.pipeline_micro_batches < 0:
            raise ValueError(
                "pipeline_parallel_size must be >= 1 and pipeline_micro_batches >= 0, got "
                f"{size} and {self.pipeline_micro_batches}"
            )
        partition = self.pipeline_layer_partition
        if partition and (len(partition) != size or min(partition) < 1):
            raise ValueError(
                f"pipeline_layer_partition: {size} positive layer counts (one per stage), got "
                f"{','.join(map(str, partition))}"
            )
        if size == 1:
            return
        if self.mode is EngineMode.SPLIT:
            raise ValueError(
                "mode: a split engine runs on one device, not with pipeline parallelism "
                f"(pipeline_parallel_size={size})"
            )

    @property
    def num_ranks(self) -> int:
        """Processes (devices) of one engine: pipeline stages x tensor-parallel ranks."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def cross_step_pipeline(self) -> bool:
        """Decode groups stay in flight across steps (`pipeline_schedule`)."""
        return (
            self.pipeline_parallel_size > 1
            and self.pipeline_schedule == "cross_step"
            and self.overlap_scheduling
        )

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step, and with the cross-step schedule the decode groups
        (`pipeline_micro_batches`; 0: twice the stages, or the stages across steps)."""
        stages = self.pipeline_parallel_size
        return self.pipeline_micro_batches or (stages if self.cross_step_pipeline else 2 * stages)

    @property
    def lora_enabled(self) -> bool:
        """LoRA is served (`enable_lora`, or adapters given in `loras`)."""
        return self.enable_lora or bool(self.loras)
