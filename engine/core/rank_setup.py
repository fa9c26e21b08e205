"""One rank's tensors: its model (or its part of it), KV pool and runner, built in one order.

`LLMEngine` (rank 0, or the only rank) and every tensor-parallel follower
(engine/core/tp_runner.py) call `build_rank`, so all ranks run the same start-up collectives in
the same order:

    load the model (a TP rank: its part, engine/tp/tp_shard.py) → attach the group's all-reduce
    → FP8 quantization and calibration (a forward pass: all-reduces; the ranks agree on the
    max of every amax) → size the KV pool (the ranks agree on the smallest block count, the
    block ids being the same on every rank) → allocate it (in `EngineConfig.kv_layout`) →
    the runner (CUDA-graph capture: more forwards, on every rank)

With one rank and no group this is exactly the engine's single-device start-up. A pipeline
stage's rank (`pp`, engine/pp/pipeline_group.py) loads only its stage's layers (of its TP part),
its stage's TP group summing its layers' outputs; FP8 calibration runs through the stages
(engine/loading/fp8_calibration.py, its `StageRelay`), each stage calibrating its layers, and
the ranks put every stage's e4m3 KV scales together (`RankParts.model_kv_scales`, for the
hand-off's compatibility hash); the block count is agreed over every rank of the worker, and
so is the host tier's (`RankParts.num_host_blocks`: the slot ids are the same on every stage).
Its pool holds its stage's layers (the spec names them: `pp_rank`, `layer_start`,
`model_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.core.runner import ModelRunner
from engine.kv.kv_cache import FP8_KV_DTYPE, KVCache, torch_dtype
from engine.kv.kv_sizing import (
    decide_num_host_blocks,
    decide_num_kv_blocks,
    kv_cache_spec,
    kv_layout,
)
from engine.loading.fp8_calibration import prepare_fp8
from engine.loading.loaders import load_model
from engine.lora.lora_apply import LoraWeights
from engine.modeling.llama import LlamaModel
from engine.pp.pipeline_group import PPGroup
from engine.pp.pp_stage import PPStage
from engine.tp.tensor_parallel import TPGroup
from engine.tp.tp_shard import check_tp_size
from vocabulary.model_config import ModelConfig
from vocabulary.tokenizer import Tokenizer


@dataclass(frozen=True)
class RankParts:
    """What `build_rank` made: the model (part), its KV pool and the runner over both."""

    model: LlamaModel
    kv_cache: KVCache
    runner: ModelRunner
    num_host_blocks: int = 0
    """Blocks of the host KV tier (`decide_num_host_blocks`; every rank's the same)."""
    model_kv_scales: tuple[float, ...] = ()
    """A pipeline stage's e4m3 pool: the whole model's KV scales (every stage's, in layer
    order); empty otherwise (a whole model's pool holds them all: `KVCacheSpec.scales`)."""


def serving_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """Longest prompt + output an engine of `config` serves (the model's limit at most)."""
    model_len = model_config.max_model_len
    return min(config.max_model_len or model_len, model_len)


def check_tp_config(config: EngineConfig, model_config: ModelConfig, tp: TPGroup | None) -> None:
    """Raise ValueError unless `tp` is the group `config` asks for (None for one rank) and
    its size splits the model."""
    size = config.tensor_parallel_size
    if size == 1 and tp is None:
        return
    if tp is None:
        raise ValueError(
            f"tensor_parallel_size={size} needs this rank's TP group "
            "(engine.tp.tensor_parallel.init_tp_group)"
        )
    if tp.size != size:
        raise ValueError(f"tensor_parallel_size={size}, but the TP group has {tp.size} ranks")
    check_tp_size(model_config, size)


def check_pp_config(config: EngineConfig, model_config: ModelConfig, pp: PPGroup | None) -> None:
    """Raise ValueError unless `pp` is the group `config` asks for (None for one stage), its
    stages cut the model's layers as configured and each stage's TP size splits the model."""
    size = config.pipeline_parallel_size
    if size == 1 and pp is None:
        return
    if pp is None:
        raise ValueError(
            f"pipeline_parallel_size={size} needs this rank's group "
            "(engine.pp.pipeline_group.init_pp_group)"
        )
    expected = PPStage.of(
        model_config.num_layers, size, pp.stage.rank, config.pipeline_layer_partition
    )
    if pp.stage != expected or pp.tp_size != config.tensor_parallel_size:
        raise ValueError(
            f"pipeline_parallel_size={size} x tensor_parallel_size="
            f"{config.tensor_parallel_size} cutting layers at {expected.bounds}, but the group "
            f"is {pp.stage.size} x {pp.tp_size} at {pp.stage.bounds}"
        )
    check_tp_size(model_config, config.tensor_parallel_size)


def build_rank(
    config: EngineConfig,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    tokenizer: Tokenizer,
    *,
    tp: TPGroup | None = None,
    pp: PPGroup | None = None,
    model: LlamaModel | None = None,
    lora_weights: LoraWeights | None = None,
) -> RankParts:
    """Build this rank's parts (see the module docstring). `model`: already loaded on the
    device and dtype (a TP rank's part for `tp`); `lora_weights`: the adapter slots (one
    rank only); `pp`: a pipeline worker's group (then `tp` is None: the stage's TP group is
    `pp.tp`)."""
    stage = None
    if pp is not None:
        if tp is not None:
            raise ValueError("a pipeline rank's TP group is its PPGroup's (`pp.tp`)")
        check_pp_config(config, model_config, pp)
        tp, stage = pp.tp, pp.stage
    else:
        check_pp_config(config, model_config, None)
        check_tp_config(config, model_config, tp)
    shard = tp.shard if tp is not None else None
    if model is None:  # FP8 (configured, or the checkpoint's own) is made while loading
        model = load_model(
            config.model_dir, dtype, device, quantization=config.quantization,
            load_format=config.load_format, seed=config.seed, shard=shard, stage=stage,
        )  # fmt: skip
    elif model.tp_shard != shard or model.pp_stage != stage:
        raise ValueError(
            f"the model given holds TP part {model.tp_shard} of stage {model.pp_stage}, this "
            f"rank is {shard} of {stage}"
        )
    # A TP rank's or stage's pool and calibration are sized by its part's config
    cfg = model_config if tp is None and stage is None else model.cfg
    if tp is not None:
        model.use_all_reduce(tp.all_reduce)
    # FP8 weights and scales before sizing the KV pool: it gets the memory freed
    kv_scales = prepare_fp8(
        model, tokenizer.encode, config.quantization, config.kv_cache_dtype,
        serving_max_model_len(config, model_config),
        agree_max=tp.reduce_max if tp is not None else None,
        activation_scales=config.fp8_activation_scales, relay=pp,
    )  # fmt: skip
    model_kv_scales: tuple[float, ...] = ()
    if pp is not None and stage is not None and kv_scales:
        places = [0.0] * 2 * stage.model_layers  # scales are > 0: the max puts each in place
        places[2 * stage.layer_start : 2 * stage.layer_end] = kv_scales
        model_kv_scales = tuple(pp.reduce_max(places))
    kv_dtype = torch_dtype(FP8_KV_DTYPE) if kv_scales else dtype
    num_blocks = decide_num_kv_blocks(config, cfg, device, kv_dtype, model, kv_scales)
    group = pp if pp is not None else tp
    if group is not None:
        num_blocks = group.reduce_min(num_blocks)
    pools = (1, 0, 0, 0)
    if stage is not None:
        pools = (stage.size, stage.rank, stage.layer_start, stage.model_layers)
    spec = kv_cache_spec(
        cfg, config.block_size, kv_dtype, num_blocks, kv_scales, shard,
        layout=kv_layout(config, device), model_kv_heads=model_config.num_kv_heads,
        weights=model.quantization, stage=pools,
    )  # fmt: skip
    kv_cache = KVCache(spec, device)
    # a stage's block holds its layers: the tier is sized by the whole model's blocks
    model_block = spec.block_nbytes // spec.num_layers * spec.total_layers
    num_host_blocks = decide_num_host_blocks(config, model_block, num_blocks)
    if pp is not None:
        num_host_blocks = pp.reduce_min(num_host_blocks)
    runner = ModelRunner(model, kv_cache, config, lora_weights)
    return RankParts(model, kv_cache, runner, num_host_blocks, model_kv_scales)
