"""The Hugging Face Llama layout: stream safetensors (single file or sharded) into an engine
`LlamaModel`, and the names and shapes every loader shares.

Tensors are read one at a time and copied into place (converted to the model's dtype and
device on the way), so peak host memory is one tensor, not the checkpoint. q/k/v and gate/up
land in slices of the fused parameters. Every parameter must be filled exactly once; a
missing or unexpected tensor is an error that names it. With a `TPShard` of size > 1 each
checkpoint tensor is read only as far as the rank's part needs (safetensors slices).
engine/loading/loaders.py picks the loader of a checkpoint's weight format.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn

from engine.modeling.llama import DecoderLayer, LlamaModel, Rotary
from engine.tp.tp_shard import FUSED_MODULES, WHOLE, Slice, TPShard, tensor_slice
from vocabulary.model_config import ModelConfig

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""The fused decoder projections (`DecoderLayer` parameters; keys of `DecoderLayer.quantized`)."""


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of each fused projection."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "qkv_proj": (q + 2 * kv, h),
        "o_proj": (h, q),
        "gate_up_proj": (2 * inter, h),
        "down_proj": (h, inter),
    }


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of each decoder Linear module as a checkpoint names it (`self_attn.q_proj`,
    ..., `mlp.down_proj`)."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
    }  # fmt: skip


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
                yield name, _part(part, view, partial(f.get_tensor, name))


def shard_tensors(
    tensors: Iterator[tuple[str, torch.Tensor]], cfg: ModelConfig, shard: TPShard
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank `shard.rank`'s part of each whole checkpoint tensor (as `iter_checkpoint` reads
    it with `shard`; for tensors made at load from others, e.g. a GPTQ checkpoint's)."""
    for name, tensor in tensors:
        part = tensor_slice(name, tuple(tensor.shape), cfg, shard)
        yield name, _part(part, tensor, tensor)


def _part(part: Slice, view: Any, whole: torch.Tensor | Callable[[], torch.Tensor]) -> torch.Tensor:
    """`part` of a tensor, read through `view` (a tensor or a safetensors slice); `whole`:
    the whole tensor, or how to read it."""
    if part.zeros or part == WHOLE:
        tensor = whole if isinstance(whole, torch.Tensor) else whole()
        return torch.zeros_like(tensor) if part.zeros else tensor
    if part.dim == 0:
        return view[part.start : part.stop]
    return view[:, part.start : part.stop].contiguous()  # (a tensor's column slice is a view)


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


def check_complete_but_projections(cfg: ModelConfig, seen: set[str]) -> None:
    """`check_complete` over every tensor but the decoder projections' weights (a quantized
    checkpoint's loader checks those, in its own format)."""
    projections = tuple(f".{m}.weight" for ms in FUSED_MODULES.values() for m in ms)
    check_complete([n for n in expected_tensor_names(cfg) if not n.endswith(projections)], seen)


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
    """A model for loaders that fill `DecoderLayer.quantized` themselves: embeddings, norms, biases
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


def hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (fused tensors split back)."""
    out: dict[str, torch.Tensor] = {}
    for name in expected_tensor_names(model.cfg):
        target = _target(model, name)
        assert target is not None
        param, start, end, _ = target
        out[name] = param.data[start:end].detach().clone().contiguous()
    return out
