"""Stream Hugging Face safetensors (single file or sharded) into an engine `LlamaModel`.

Tensors are read one at a time and copied into place (converted to the model's dtype and
device on the way), so peak host memory is one tensor, not the checkpoint. q/k/v and gate/up
land in slices of the fused parameters. Every parameter must be filled exactly once; a
missing or unexpected tensor is an error that names it.

`load_model` picks the way in (`EngineConfig.quantization` and `load_format`):

    dense checkpoint, quantization none   LlamaModel in the dtype, `load_weights`
    dense checkpoint, quantization fp8    each fused projection quantized as soon as its parts
                                          are read (engine/fp8_checkpoint.py): the dense
                                          projections never exist on the device
    FP8 checkpoint (compressed-tensors)   read as FP8 whatever quantization says (logged)
    load_format dummy                     random weights from config.json (engine/dummy_weights.py),
                                          with fp8 made layer by layer straight into FP8

The FP8 ways build the model with `empty_model` (its projections allocated by nobody but
the loader) and set `model.quantization = "fp8"`.

With a `TPShard` of size > 1 every way builds that rank's part (engine/tp_shard.py): a model
of the part's config, each checkpoint tensor read only as far as the part needs (safetensors
slices), dummy weights drawn whole and cut, so each rank's part is the same whatever the size.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open
from torch import nn

from engine.config import LOAD_FORMATS, QUANTIZATIONS
from engine.model import DecoderLayer, LlamaModel, Rotary
from engine.model_config import ModelConfig
from engine.tp_shard import WHOLE, TPShard, check_tp_size, local_config, tensor_slice

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""The fused decoder projections (`DecoderLayer` parameters; keys of `DecoderLayer.fp8`)."""


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of each fused projection."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "qkv_proj": (q + 2 * kv, h),
        "o_proj": (h, q),
        "gate_up_proj": (2 * inter, h),
        "down_proj": (h, inter),
    }


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (honouring a shard index if present)."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / n for n in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {root}")
    return files


def _target(model: LlamaModel, name: str) -> tuple[torch.Tensor, int, int, str] | None:
    """(parameter, row start, row end, key) for an HF tensor name; None to skip it."""
    cfg = model.cfg
    if name == "model.embed_tokens.weight":
        return model.embed_tokens, 0, cfg.vocab_size, name
    if name == "model.norm.weight":
        return model.norm.weight, 0, cfg.hidden_size, name
    if name == "lm_head.weight":
        if model.lm_head is None:
            return None  # tied: some checkpoints store the tied copy anyway
        return model.lm_head, 0, cfg.vocab_size, name
    m = _LAYER.match(name)
    if m is None:
        if name.endswith("rotary_emb.inv_freq"):
            return None
        raise ValueError(f"unexpected tensor {name!r} in checkpoint")
    i, rest = int(m.group(1)), m.group(2)
    if i >= cfg.num_layers:
        raise ValueError(f"tensor {name!r} is beyond num_hidden_layers={cfg.num_layers}")
    layer = cast(DecoderLayer, model.layers[i])
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    fused: dict[str, tuple[torch.Tensor | None, int, int]] = {
        "self_attn.q_proj.weight": (layer.qkv_proj, 0, q),
        "self_attn.k_proj.weight": (layer.qkv_proj, q, q + kv),
        "self_attn.v_proj.weight": (layer.qkv_proj, q + kv, q + 2 * kv),
        "self_attn.q_proj.bias": (layer.qkv_bias, 0, q),
        "self_attn.k_proj.bias": (layer.qkv_bias, q, q + kv),
        "self_attn.v_proj.bias": (layer.qkv_bias, q + kv, q + 2 * kv),
        "self_attn.o_proj.weight": (layer.o_proj, 0, cfg.hidden_size),
        "self_attn.o_proj.bias": (layer.o_bias, 0, cfg.hidden_size),
        "self_attn.q_norm.weight": (
            layer.q_norm.weight if layer.q_norm is not None else None,
            0,
            cfg.head_dim,
        ),
        "self_attn.k_norm.weight": (
            layer.k_norm.weight if layer.k_norm is not None else None,
            0,
            cfg.head_dim,
        ),
        "input_layernorm.weight": (layer.input_layernorm.weight, 0, cfg.hidden_size),
        "post_attention_layernorm.weight": (
            layer.post_attention_layernorm.weight,
            0,
            cfg.hidden_size,
        ),
        "mlp.gate_proj.weight": (layer.gate_up_proj, 0, inter),
        "mlp.up_proj.weight": (layer.gate_up_proj, inter, 2 * inter),
        "mlp.down_proj.weight": (layer.down_proj, 0, cfg.hidden_size),
    }
    if rest not in fused:
        raise ValueError(f"unexpected tensor {name!r} in checkpoint")
    param, start, end = fused[rest]
    if param is None:
        raise ValueError(f"tensor {name!r} does not fit this config ({cfg.model_type})")
    return param, start, end, name


def expected_tensor_names(cfg: ModelConfig) -> list[str]:
    """Every Hugging Face tensor name a checkpoint of this config must provide."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    if cfg.attention_bias:
        per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    if cfg.o_proj_bias:
        per_layer.append("self_attn.o_proj.bias")
    if cfg.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for i in range(cfg.num_layers):
        names += [f"model.layers.{i}.{n}" for n in per_layer]
    return names


def iter_checkpoint(
    model_dir: str | Path, cfg: ModelConfig | None = None, shard: TPShard | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a checkpoint, one tensor in memory at a time; with `shard`
    (and the whole model's `cfg`) only that rank's part of each tensor is read."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if shard is None or shard.size == 1:
                    yield name, f.get_tensor(name)
                    continue
                assert cfg is not None, "a sharded read needs the model's config"
                view = f.get_slice(name)
                part = tensor_slice(name, tuple(view.get_shape()), cfg, shard)
                if part.zeros:
                    yield name, torch.zeros_like(f.get_tensor(name))
                elif part == WHOLE:
                    yield name, f.get_tensor(name)
                elif part.dim == 0:
                    yield name, view[part.start : part.stop]
                else:
                    yield name, view[:, part.start : part.stop]


def copy_tensor(model: LlamaModel, name: str, tensor: torch.Tensor) -> str | None:
    """Copy one HF-named tensor into its place in `model` (converted to the parameter's dtype
    and device); the name it fills, or None for a tensor skipped (a tied head's copy, RoPE
    tables). Raises naming an unexpected or misshapen tensor."""
    target = _target(model, name)
    if target is None:
        return None
    param, start, end, key = target
    dest = param.data[start:end]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, config expects {tuple(dest.shape)}"
        )
    dest.copy_(tensor)
    return key


def check_complete(names: Iterable[str], seen: set[str]) -> None:
    """Raise naming the first of `names` (what a checkpoint must provide) not in `seen`."""
    missing = [n for n in names if n not in seen]
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing {', '.join(missing[:5])}{more}")


@torch.no_grad()
def load_weights(model: LlamaModel, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the model; raise naming any missing or misshapen tensor."""
    seen: set[str] = set()
    for name, tensor in tensors:
        key = copy_tensor(model, name, tensor)
        if key is not None:
            seen.add(key)
    check_complete(expected_tensor_names(model.cfg), seen)


def empty_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> LlamaModel:
    """A model for loaders that fill `DecoderLayer.fp8` themselves: embeddings, norms, biases
    and head allocated (uninitialized) on `device`, the dense projections empty placeholders
    in the model dtype (as `quantize_fp8` leaves them). It is built on the meta device, so the
    dense projections are never allocated anywhere."""
    device = torch.device(device)
    model = LlamaModel(cfg, dtype=dtype, device="meta")
    for layer in model.layers:
        for name in PROJECTIONS:
            empty = torch.empty(0, dtype=dtype, device="meta")
            setattr(layer, name, nn.Parameter(empty, requires_grad=False))
    model.to_empty(device=device)
    model.device = device
    model.rotary = Rotary(cfg, device)  # its tables are computed, not loaded
    return model


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    quantization: str = "none",
    load_format: str = "auto",
    seed: int = 0,
    shard: TPShard | None = None,
) -> LlamaModel:
    """Build a LlamaModel from a Hugging Face checkpoint folder on local disk (the ways in:
    see the module docstring). `seed` seeds dummy weights; `shard`: the tensor-parallel
    rank's part only (`model.tp_shard`; ValueError for a TP size that does not split it)."""
    from engine.fp8_checkpoint import load_fp8_weights, read_fp8_scheme

    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a Hugging Face checkpoint folder")
    raw = json.loads(path.read_text())
    cfg = ModelConfig.from_dict(raw)
    if shard is not None and shard.size == 1:
        shard = None
    if shard is not None:
        check_tp_size(cfg, shard.size)
    local = cfg if shard is None else local_config(cfg, shard)
    scheme = read_fp8_scheme(raw)
    if scheme is not None and quantization != "fp8":
        log.info("%s is an FP8 checkpoint (%s): loading FP8 weights", model_dir, scheme)
    fp8 = quantization == "fp8" or scheme is not None
    if load_format == "dummy":
        from engine.dummy_weights import dummy_model

        return dummy_model(cfg, dtype, device, fp8=fp8, seed=seed, shard=shard).eval()
    if fp8:
        model = empty_model(local, dtype, device)
        load_fp8_weights(model, iter_checkpoint(model_dir, cfg, shard), scheme)
    else:
        model = LlamaModel(local, dtype=dtype, device=device)
        load_weights(model, iter_checkpoint(model_dir, cfg, shard))
    model.tp_shard = shard
    return model.eval()


def hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (fused tensors split back)."""
    out: dict[str, torch.Tensor] = {}
    for name in expected_tensor_names(model.cfg):
        target = _target(model, name)
        assert target is not None
        param, start, end, _ = target
        out[name] = param.data[start:end].detach().clone().contiguous()
    return out
