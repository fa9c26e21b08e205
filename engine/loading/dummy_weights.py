"""`load_format=dummy`: random weights made on the device from config.json alone (vLLM's
convention), so a shape whose checkpoint is not on disk (Llama-3-70B: 140 GB in bf16) can be
served and measured.

Values: every matrix normal(0, INIT_STD) (embeddings, projections, head), every norm 1,
every bias 0, drawn in that order from one generator on the device seeded by `seed`: the
same seed gives the same weights on the same device. With RMSNorm in front of every
projection, activations stay of order one and the logits finite at any depth.

With `fp8` the model is made layer by layer straight into FP8: each fused projection is
drawn in float32, quantized (`quantize_per_tensor`, as `quantize_fp8` would) and dropped
before the next, so the device never holds more than one projection in float32 beside the
FP8 weights (for Llama-3-70B ~72 GB in all, 1.9 GB the largest float32 projection). The
values are those of the dense dummy model quantized: same seed, same draws. With an INT
`int_scheme` the same, each projection quantized as a compressed-tensors INT checkpoint of
that scheme stores it (INT8: int8 with one scale per row, amax / 127; INT4: int4 in [-7, 7]
per group, amax / 7, packed), so a 70B INT4 shape (~35 GB) is served without a checkpoint.

With a `shard` (tensor parallelism, engine/tp/tp_shard.py) every projection is still drawn whole,
in the same order, and only the rank's part kept: a rank's weights are those parts of the
whole dummy model of the same seed, whatever the TP size. With a pipeline `stage` every
layer is still drawn, in the same order, and only the stage's layers kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from engine.loading.hf_checkpoint import PROJECTIONS, empty_model, projection_shapes
from engine.modeling.llama import DecoderLayer, LlamaModel, RMSNorm
from engine.pp.pp_stage import PPStage, stage_config
from engine.quantization.fp8_linear import Fp8Linear, quantize_per_tensor
from engine.quantization.int4_linear import Int4Linear, pack_int4, quantize_groups_int4
from engine.quantization.int8_linear import INT8_MAX, Int8Linear, quantize_rows_int8
from engine.tp.tp_shard import TPShard, local_config, shard_fused
from vocabulary.model_config import ModelConfig

if TYPE_CHECKING:
    from engine.loading.int_checkpoint import IntScheme

INIT_STD = 0.02


@torch.no_grad()
def dummy_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    fp8: bool = False,
    seed: int = 0,
    shard: TPShard | None = None,
    int_scheme: IntScheme | None = None,
    stage: PPStage | None = None,
) -> LlamaModel:
    """A model of `cfg` with random weights (see the module docstring); FP8 projections
    (`model.quantization == "fp8"`) with `fp8`, INT8 or INT4 ones with `int_scheme`; only rank
    `shard.rank`'s part with `shard`; only `stage`'s layers with `stage`."""
    if fp8 and int_scheme is not None:
        raise ValueError(f"dummy weights: FP8 or {int_scheme}, not both")
    quantized = fp8 or int_scheme is not None
    device = torch.device(device)
    if shard is not None and shard.size == 1:
        shard = None
    local = cfg if shard is None else local_config(cfg, shard)
    if stage is not None:
        local = stage_config(local, stage)
    start = 0 if stage is None else stage.layer_start
    model = empty_model(local, dtype, device) if quantized else LlamaModel(local, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32, device=device)
        return t.normal_(0.0, INIT_STD, generator=gen)

    model.embed_tokens.copy_(normal(tuple(model.embed_tokens.shape)))
    shapes = projection_shapes(cfg)
    for i in range(cfg.num_layers):
        if stage is not None and not stage.holds(i):
            for name in PROJECTIONS:  # drawn all the same: the stage's layers are the model's
                normal(shapes[name])
            continue
        layer = cast(DecoderLayer, model.layers[i - start])
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.q_norm,
                     layer.k_norm):  # fmt: skip
            if isinstance(norm, RMSNorm):
                norm.weight.fill_(1.0)
        for bias in (layer.qkv_bias, layer.o_bias):
            if bias is not None:
                bias.zero_()
        linears: dict[str, nn.Module] = {}
        for name in PROJECTIONS:
            weight = normal(shapes[name])
            if shard is not None:
                weight = shard_fused(name, weight, cfg, shard)
            if fp8:
                linears[name] = Fp8Linear(*quantize_per_tensor(weight), layer.projection_bias(name))
            elif int_scheme is not None:
                linears[name] = int_linear(weight, int_scheme, layer.projection_bias(name))
            else:
                getattr(layer, name).copy_(weight)
            del weight
        if quantized:
            layer.quantized = nn.ModuleDict(linears)
    model.norm.weight.fill_(1.0)
    if model.lm_head is not None:
        model.lm_head.copy_(normal(tuple(model.lm_head.shape)))
    if fp8:
        model.quantization = "fp8"
    elif int_scheme is not None:
        model.quantization = int_scheme.name
    model.tp_shard = shard
    return model


def int_linear(weight: torch.Tensor, scheme: IntScheme, bias: torch.Tensor | None) -> nn.Module:
    """float32 `weight` [out, in] as `scheme` stores it (module docstring)."""
    if scheme.bits == 8:
        q, scale = quantize_rows_int8(weight, INT8_MAX)
        return Int8Linear(q, scale, bias)
    q, scale = quantize_groups_int4(weight, scheme.group_size)
    return Int4Linear(pack_int4(q), scale, weight.shape[1], scheme.group_size, bias)
