"""LoRA adapters in the PEFT format, read from local disk and checked against the base model.

A PEFT adapter is a folder with `adapter_config.json` and `adapter_model.safetensors` (what
`PeftModel.save_pretrained` writes). Each targeted module of each layer has two tensors,

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

and the adapted projection computes `W x + (B (A x)) * scaling`, scaling = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora). The engine fuses q/k/v and gate/up into one matmul
each (engine/modeling/llama.py), so an adapter maps onto the fused projections: `FUSED_TARGETS` says
which fused projection, and which part of it, each PEFT module lands in; a module the adapter
does not target contributes zero.

Two steps, so that a bad folder fails where it is named (`LoraCache.register`) and the costly
read runs off the engine's thread (the cache's loader):

- `read_adapter_spec(path, cfg, max_rank)`: the config and the safetensors header only (no
  tensor data): refuses what the engine cannot serve (a field that changes the math: DoRA,
  biases, fan_in_fan_out, per-module ranks, extra trainable modules), ranks above `max_rank`,
  modules other than the seven projections, layers or shapes that do not fit the model.
  Every error is a ValueError naming the field or tensor, and the folder.
- `load_adapter(spec, dtype, pin)`: the tensors, in the layout a device slot is filled from
  (A as [layers, r, in], B transposed to [layers, r, out] with the scaling folded in), pinned
  when the device is a GPU so the upload is an asynchronous copy.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from vocabulary.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_MAX_LORA_RANK = 64

FUSED_TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
"""PEFT module → (fused engine projection, index of its part in that projection's output)."""
LORA_MODULES = tuple(FUSED_TARGETS)

_ATTENTION = ("qkv_proj", "o_proj")
_PARENT = {m: "self_attn" if p in _ATTENTION else "mlp" for m, (p, _) in FUSED_TARGETS.items()}
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
_UNSUPPORTED_FIELDS = (
    "use_dora",
    "fan_in_fan_out",
    "lora_bias",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "layer_replication",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "target_parameters",
    "use_qalora",
    "use_bdlora",
    "arrow_config",
    "monteclora_config",
)
"""Config fields that change the forward math when set (truthy): refused, named."""


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of a PEFT module of this model."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }[module]


def tensor_name(layer: int, module: str, which: str) -> str:
    """The safetensors key of lora_{which} (A or B) of `module` in `layer`."""
    return f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}.lora_{which}.weight"


@dataclass(frozen=True)
class LoraSpec:
    """What an adapter folder holds, checked against the base model (no tensor data)."""

    path: Path
    rank: int
    scaling: float
    """lora_alpha / rank, or lora_alpha / sqrt(rank) with use_rslora."""
    modules: tuple[str, ...]
    """The PEFT modules it targets (a subset of LORA_MODULES, in that order)."""
    layers: tuple[tuple[int, ...], ...]
    """Per module of `modules`: the layers that carry it (all of them unless the adapter
    was trained with layers_to_transform)."""


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter's weights on the host, in the layout a device slot is filled from."""

    spec: LoraSpec
    a: dict[str, torch.Tensor]
    """module → [num_layers, rank, in] (zeros in layers the adapter leaves alone)."""
    b: dict[str, torch.Tensor]
    """module → [num_layers, rank, out]: lora_B transposed, times the scaling."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))


def _fail(path: Path, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {path}: {what}")


def _read_config(path: Path) -> dict[str, object]:
    if not path.is_dir():
        raise _fail(path, "not a directory")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise _fail(
                path,
                f"{name} not found (a PEFT adapter folder has {CONFIG_FILE} and {WEIGHTS_FILE})",
            )
    try:
        raw = json.loads((path / CONFIG_FILE).read_text())
    except json.JSONDecodeError as e:
        raise _fail(path, f"{CONFIG_FILE} is not JSON: {e}") from e
    if not isinstance(raw, dict):
        raise _fail(path, f"{CONFIG_FILE} is not a JSON object")
    return raw


def _check_fields(path: Path, raw: dict[str, object], max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a config the engine can serve; ValueError naming the field if not."""
    if raw.get("peft_type", "LORA") != "LORA":
        raise _fail(path, f"peft_type {raw.get('peft_type')!r} is not supported (only LORA)")
    if raw.get("bias", "none") != "none":
        raise _fail(path, f"bias={raw['bias']!r} is not supported (only 'none')")
    for field in _UNSUPPORTED_FIELDS:
        if raw.get(field):
            raise _fail(path, f"{field}={raw[field]!r} is not supported")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _fail(path, f"r={rank!r}: want a positive integer")
    if rank > max_rank:
        raise _fail(path, f"r={rank} is above the largest rank served (max_lora_rank={max_rank})")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise _fail(path, f"lora_alpha={alpha!r}: want a number")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        for t in targets:
            if str(t).rsplit(".", 1)[-1] not in FUSED_TARGETS:
                supported = ", ".join(LORA_MODULES)
                raise _fail(path, f"target_modules: {t!r} is not supported ({supported})")
    return rank, float(scaling)


def _read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    try:
        with safe_open(str(path / WEIGHTS_FILE), framework="pt", device="cpu") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise _fail(path, f"{WEIGHTS_FILE} cannot be read: {e}") from e


def read_adapter_spec(
    path: str | Path, cfg: ModelConfig, max_rank: int = DEFAULT_MAX_LORA_RANK
) -> LoraSpec:
    """Check an adapter folder against the model (config and tensor shapes, no tensor data);
    ValueError naming what is wrong (see the module docstring)."""
    path = Path(path)
    raw = _read_config(path)
    rank, scaling = _check_fields(path, raw, max_rank)
    found: dict[str, dict[int, set[str]]] = {}
    for key, shape in _read_shapes(path).items():
        m = _KEY.match(key)
        if m is None:
            supported = ", ".join(LORA_MODULES)
            raise _fail(path, f"unexpected tensor {key!r} (only lora_A/B of {supported})")
        layer, parent, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in FUSED_TARGETS or _PARENT[module] != parent:
            raise _fail(path, f"tensor {key!r}: module {parent}.{module} is not supported")
        if layer >= cfg.num_layers:
            raise _fail(path, f"tensor {key!r}: layer {layer} >= num_layers {cfg.num_layers}")
        fan_in, fan_out = module_shape(cfg, module)
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if shape != want:
            raise _fail(path, f"tensor {key!r} has shape {shape}, want {want} (r={rank})")
        found.setdefault(module, {}).setdefault(layer, set()).add(which)
    if not found:
        raise _fail(path, f"{WEIGHTS_FILE} holds no LoRA tensors")
    all_layers = raw.get("layers_to_transform") is None
    modules = tuple(m for m in LORA_MODULES if m in found)
    for module in modules:
        for layer in range(cfg.num_layers):
            parts = found[module].get(layer, set())
            if parts == {"A", "B"} or (not parts and not all_layers):
                continue
            which = "A" if "A" not in parts else "B"
            raise _fail(path, f"tensor {tensor_name(layer, module, which)!r} is missing")
    layers = tuple(tuple(sorted(found[m])) for m in modules)
    return LoraSpec(path=path, rank=rank, scaling=scaling, modules=modules, layers=layers)


def _finite(spec: LoraSpec, t: torch.Tensor) -> torch.Tensor:
    # one NaN would reach every token of a step through the dense kernel (0 * NaN = NaN)
    if not bool(torch.isfinite(t).all()):
        raise _fail(spec.path, "holds non-finite values (NaN or inf)")
    return t


def load_adapter(
    spec: LoraSpec,
    cfg: ModelConfig,
    dtype: torch.dtype,
    pin: bool = False,
    layers: range | None = None,
) -> LoraAdapter:
    """Read an adapter's tensors (checked by `read_adapter_spec`) into host memory, in `dtype`
    (pinned with `pin`), A as [layers, r, in] and B as [layers, r, out] times the scaling.
    `layers`: only those model layers (a pipeline stage's), numbered from 0; None: every
    layer of `cfg`. ValueError if a tensor read holds NaN or inf."""
    a: dict[str, torch.Tensor] = {}
    b: dict[str, torch.Tensor] = {}
    held = range(cfg.num_layers) if layers is None else layers
    rank, num_layers = spec.rank, len(held)
    with safe_open(str(spec.path / WEIGHTS_FILE), framework="pt", device="cpu") as f:
        for module, carried in zip(spec.modules, spec.layers, strict=True):
            fan_in, fan_out = module_shape(cfg, module)
            a_m = torch.zeros((num_layers, rank, fan_in), dtype=dtype, pin_memory=pin)
            b_m = torch.zeros((num_layers, rank, fan_out), dtype=dtype, pin_memory=pin)
            for layer in carried:
                if layer not in held:
                    continue
                weight_a = _finite(spec, f.get_tensor(tensor_name(layer, module, "A")))
                weight_b = _finite(spec, f.get_tensor(tensor_name(layer, module, "B")))
                a_m[layer - held.start].copy_(weight_a)
                b_m[layer - held.start].copy_((weight_b.float() * spec.scaling).t())
            a[module], b[module] = a_m, b_m
    return LoraAdapter(spec=spec, a=a, b=b)
