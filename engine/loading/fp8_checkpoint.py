"""Pre-quantized FP8 checkpoints in the compressed-tensors `float-quantized` format (what
llm-compressor writes, and most FP8 Llama checkpoints on the Hugging Face Hub use), read
straight into the model's FP8 projections; dense checkpoints quantized the same way as they
stream in.

The format, as config.json and tensor names give it:

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "float-quantized",
      "quantization_status": "compressed", "kv_cache_scheme": null, "ignore": ["lm_head"],
      "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "symmetric": true, "dynamic": false,
                    "strategy": "tensor" | "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": true,
                              "dynamic": false, "strategy": "tensor"}        (static)
                           | {..., "dynamic": true, "strategy": "token"}     (dynamic)
                           | null }}}                                        (weights only)

    <module>.weight         float8_e4m3fn [out, in]       weight ≈ weight.float() * weight_scale
    <module>.weight_scale   [] or [1] (tensor), [out, 1] (channel)
    <module>.input_scale    [] or [1], static activations only
    Modules in `ignore` (the head) and all that is not a Linear are stored as in a dense
    checkpoint. A group may carry its own "format"; every group must be FP8 and agree.

What the engine makes of it: what the checkpoint declares (engine/quantization/fp8_linear.py).
- q/k/v and gate/up are separate modules in the checkpoint and one fused projection here.
  Parts that are per-tensor with one shared scale keep their e4m3 bytes and that scale; any
  other mix (per-tensor scales that differ, per-channel scales) keeps every part's bytes with
  a scale per row (`fuse_parts`: per-tensor parts repeat theirs over their rows; a dense part
  among quantized ones is quantized per row). No weight is rounded twice.
- Static input scales of fused parts: their max (the parts read the same input; the max
  saturates nothing any part's scale covered). Dynamic activations run as declared, per token
  or per tensor (`Fp8Linear.dynamic`); `fp8_activation_scales: calibrated` (opt-in) gives
  them one static scale instead, shared by every request (engine/loading/fp8_calibration.py).
  Weights only (no input_activations): activations stay in the model dtype and the GEMM
  reads the weight dequantized (`Fp8Linear.dynamic` "none"; correct, not fast: there is no
  FP8-weight, bf16-activation GEMM here).
- KV-cache scales (`kv_cache_scheme`, `self_attn.k_scale`/`v_scale`) are not read:
  `kv_cache_dtype=fp8` calibrates its own at load (engine/loading/fp8_calibration.py).
- An FP8 head (not in `ignore`) is dequantized: the head and embeddings stay in the dtype.

Tensors stream in one at a time (engine/loading/hf_checkpoint.py); a fused projection is built on
the device as soon as its last part has arrived and its parts are dropped, so neither the host nor
the device ever holds the dense model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from engine.loading.hf_checkpoint import (
    PROJECTIONS,
    check_complete_but_projections,
    copy_tensor,
    module_shapes,
)
from engine.modeling.llama import DecoderLayer, LlamaModel
from engine.quantization.fp8_linear import (
    FP8_DTYPE,
    Fp8Linear,
    quantize_per_tensor,
    quantize_per_token,
)
from engine.tp.tp_shard import FUSED_MODULES, PROJECTION_OF

QUANT_METHOD = "compressed-tensors"
FLOAT_QUANTIZED = "float-quantized"
WEIGHT_STRATEGIES = ("tensor", "channel")

_PART_TENSOR = re.compile(
    r"^model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\."
    r"(weight|weight_scale|input_scale|weight_zero_point|input_zero_point)$"
)
_KV_SCALE = re.compile(r"^model\.layers\.\d+\.self_attn\.(?:[kv]_scale|[kv]_proj\.output_scale)$")
_OTHER_LINEAR = re.compile(r"^(.+)\.(weight|weight_scale|input_scale)$")


@dataclass(frozen=True)
class Fp8Scheme:
    """How a compressed-tensors FP8 checkpoint quantizes its Linear layers."""

    weight_strategy: str = "channel"
    """tensor (one weight_scale per module) or channel (one per output row)."""
    dynamic_activations: bool = True
    """True: activations are quantized at run time (per `activation_strategy`); False:
    static, one `input_scale` per module in the checkpoint."""
    activation_strategy: str = "token"
    """Dynamic activations: token (a scale per token), tensor (one over the input), or none
    (weights only: activations stay in the model dtype, no input_activations declared)."""

    def __post_init__(self) -> None:
        if self.weight_strategy not in WEIGHT_STRATEGIES:
            raise ValueError(
                f"weight_strategy: one of {', '.join(WEIGHT_STRATEGIES)}, "
                f"got {self.weight_strategy!r}"
            )
        if self.activation_strategy not in ("token", "tensor", "none"):
            raise ValueError(
                f"activation_strategy: token, tensor or none, got {self.activation_strategy!r}"
            )

    def __str__(self) -> str:
        acts = f"dynamic per-{self.activation_strategy}" if self.dynamic_activations else "static"
        if self.weights_only:
            acts = "unquantized"
        return f"compressed-tensors FP8, per-{self.weight_strategy} weights, {acts} activations"

    @property
    def weights_only(self) -> bool:
        return self.dynamic_activations and self.activation_strategy == "none"

    def quantization_config(self) -> dict[str, Any]:
        """The config.json `quantization_config` of a checkpoint in this scheme (the head
        left dense)."""
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
        activations: dict[str, Any] | None = None  # weights only
        if self.dynamic_activations and not self.weights_only:
            activations = fp8 | {"strategy": self.activation_strategy, "dynamic": True}
        elif not self.dynamic_activations:
            activations = fp8 | {"strategy": "tensor", "dynamic": False}
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": self.weight_strategy}  # fmt: skip
        return one_group_config(FLOAT_QUANTIZED, weights, activations)


WHERE = "config.json: quantization_config"


def one_group_config(
    fmt: str, weights: dict[str, Any], activations: dict[str, Any] | None
) -> dict[str, Any]:
    """A compressed-tensors `quantization_config` of one scheme over every Linear but the
    head, in format `fmt`, as llm-compressor writes one."""
    return {
        "quant_method": QUANT_METHOD,
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": activations,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def quantization_config(raw_config: Mapping[str, Any], formats: str) -> Mapping[str, Any] | None:
    """config.json's `quantization_config` (None: a dense checkpoint), with at least one of
    `config_groups`. ValueError naming the key when it is not a mapping, not
    compressed-tensors' (`formats` says what loads) or has no groups."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ValueError(f"{WHERE}: expected a mapping, got {qc!r}")
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise ValueError(f"{WHERE}.quant_method {method!r} is not supported ({formats})")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"{WHERE}.config_groups: expected a mapping of quantized groups")
    return qc


def read_fp8_scheme(raw_config: Mapping[str, Any]) -> Fp8Scheme | None:
    """The FP8 scheme a config.json declares; None for a dense checkpoint. Raises ValueError
    naming the key for any quantization the engine does not load."""
    qc = quantization_config(raw_config, f"FP8 checkpoints load in the {FLOAT_QUANTIZED!r} format")
    if qc is None:
        return None
    where = WHERE
    groups = qc["config_groups"]
    schemes = {_group_scheme(qc, name, g, f"{where}.config_groups.{name}") for name, g in
               groups.items()}  # fmt: skip
    if len(schemes) > 1:
        raise ValueError(f"{where}.config_groups: groups disagree ({', '.join(map(str, schemes))})")
    return schemes.pop()


def _group_scheme(qc: Mapping[str, Any], name: str, group: Any, where: str) -> Fp8Scheme:
    if not isinstance(group, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {group!r}")
    fmt = group.get("format") or qc.get("format")
    if fmt != FLOAT_QUANTIZED:
        raise ValueError(f"{where}: format {fmt!r} is not supported (only {FLOAT_QUANTIZED!r})")
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise ValueError(f"{where}.weights: expected the weights' quantization")
    _check_fp8_args(weights, f"{where}.weights")
    strategy = weights.get("strategy") or (
        "channel" if weights.get("group_size") == -1 else "tensor"
    )
    if strategy not in WEIGHT_STRATEGIES or weights.get("dynamic", False):
        raise ValueError(
            f"{where}.weights: strategy {strategy!r} is not supported (static tensor or channel)"
        )
    if group.get("output_activations") is not None:
        raise ValueError(f"{where}.output_activations: not supported")
    acts = group.get("input_activations")
    if acts is None:  # weights only: activations stay in the model dtype
        return Fp8Scheme(strategy, dynamic_activations=True, activation_strategy="none")
    if not isinstance(acts, Mapping):
        raise ValueError(f"{where}.input_activations: expected a mapping, got {acts!r}")
    _check_fp8_args(acts, f"{where}.input_activations")
    dynamic = acts.get("dynamic", False)
    act_strategy = acts.get("strategy") or "tensor"
    if dynamic is True and act_strategy in ("token", "tensor"):
        return Fp8Scheme(strategy, dynamic_activations=True, activation_strategy=act_strategy)
    if dynamic is False and act_strategy == "tensor":
        return Fp8Scheme(strategy, dynamic_activations=False)
    raise ValueError(
        f"{where}.input_activations: dynamic={dynamic!r} strategy {act_strategy!r} is not "
        "supported (static tensor, or dynamic token/tensor)"
    )


def _check_fp8_args(args: Mapping[str, Any], where: str) -> None:
    bits, kind = args.get("num_bits", 8), args.get("type", "int")
    if bits != 8 or kind != "float":
        raise ValueError(f"{where}: {bits}-bit {kind} is not supported (8-bit float, e4m3)")
    if not args.get("symmetric", True):
        raise ValueError(f"{where}: asymmetric quantization is not supported")


# ---- assembling fused projections ----------------------------------------------------------


@dataclass
class Fp8Part:
    """One checkpoint Linear module's tensors (on the target device) as they arrive."""

    name: str
    """Its module path in the checkpoint (`model.layers.0.self_attn.q_proj`)."""
    weight: torch.Tensor | None = None
    """e4m3 with a weight_scale, or dense in the model dtype (a module left unquantized)."""
    weight_scale: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.weight is not None and self.weight.dtype == FP8_DTYPE

    def complete(self, static: bool) -> bool:
        """Whether every tensor this module stores has arrived."""
        if self.weight is None:
            return False
        if not self.quantized:
            return True
        return self.weight_scale is not None and (self.input_scale is not None or not static)

    @property
    def per_tensor(self) -> bool:
        return self.quantized and self.weight_scale is not None and self.weight_scale.numel() == 1

    def per_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 weight, float32 scale per row [rows]): the checkpoint's bytes with their
        scale repeated per row, or a dense part quantized row by row."""
        assert self.weight is not None
        rows = self.weight.shape[0]
        if not self.quantized:  # each row by its own amax, as an activation per token
            q, scale = quantize_per_token(self.weight)
            return q, scale.reshape(rows)
        return self.weight, self._scale().reshape(-1).expand(rows).contiguous()

    def dequantized(self) -> torch.Tensor:
        """The weight in float32 (e4m3 times its per-tensor or per-row scale)."""
        assert self.weight is not None
        if not self.quantized:
            return self.weight.float()
        return self.weight.float() * self._scale()

    def _scale(self) -> torch.Tensor:
        """The float32 weight scale as [] (per tensor) or [rows, 1] (per channel); ValueError
        naming a missing one or one of another shape."""
        assert self.weight is not None
        if self.weight_scale is None:
            raise ValueError(f"checkpoint is missing {self.name}.weight_scale")
        rows = self.weight.shape[0]
        scale = self.weight_scale.float()
        if scale.numel() == 1:
            return scale.reshape(())
        if tuple(scale.shape) in ((rows, 1), (rows,)):
            return scale.reshape(rows, 1)
        raise ValueError(
            f"tensor {self.name}.weight_scale has shape {tuple(scale.shape)}: want [] or "
            f"[1] (per tensor) or [{rows}, 1] (per channel)"
        )


def fuse_parts(parts: Sequence[Fp8Part]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(e4m3 weight, float32 scale [] or [rows], static input scale [] or None) of the row
    concatenation of `parts` (see the module docstring)."""
    weights = [p.weight for p in parts]
    assert all(w is not None for w in weights)
    scales = [p.weight_scale.float().reshape(()) for p in parts if p.per_tensor]  # type: ignore[union-attr]
    if len(scales) == len(parts) and all(bool(s == scales[0]) for s in scales):
        weight, scale = torch.cat(cast(list[torch.Tensor], weights)), scales[0]
    elif not any(p.quantized for p in parts):  # a dense checkpoint quantized here: per tensor
        weight, scale = quantize_per_tensor(torch.cat([p.dequantized() for p in parts]))
    else:  # each part's rows keep their e4m3 bytes and scales (a dense part: per row here)
        rows = [p.per_row() for p in parts]
        weight, scale = torch.cat([w for w, _ in rows]), torch.cat([s for _, s in rows])
    inputs = [p.input_scale.float().reshape(()) for p in parts if p.input_scale is not None]
    input_scale = torch.stack(inputs).amax() if inputs else None
    return weight, scale, input_scale


def _check_zero(name: str, tensor: torch.Tensor) -> None:
    if bool(tensor.ne(0).any()):
        raise ValueError(
            f"tensor {name!r}: asymmetric quantization (a zero point) is not supported"
        )


class _Assembler:
    """Collects the parts of each layer's projections and builds each Fp8Linear the moment
    its last part arrives."""

    def __init__(self, model: LlamaModel, static: bool, dynamic: str | None) -> None:
        self.model = model
        self.static = static
        self.dynamic = dynamic
        """How projections without a static input scale quantize their inputs."""
        self.part_shapes = module_shapes(model.cfg)
        self.parts: dict[tuple[int, str], Fp8Part] = {}
        self.built: dict[int, dict[str, Fp8Linear]] = {}

    def add(self, layer: int, module: str, kind: str, tensor: torch.Tensor) -> None:
        model = self.model
        name = f"model.layers.{layer}.{module}"
        if layer >= model.cfg.num_layers:
            raise ValueError(
                f"tensor {name}.{kind} is beyond num_hidden_layers={model.cfg.num_layers}"
            )
        part = self.parts.setdefault((layer, module), Fp8Part(name))
        if kind == "weight":
            want = self.part_shapes[module]
            if tuple(tensor.shape) != want:
                raise ValueError(
                    f"tensor {name}.weight has shape {tuple(tensor.shape)}, config expects {want}"
                )
            dtype = FP8_DTYPE if tensor.dtype == FP8_DTYPE else model.dtype
            part.weight = tensor.to(device=model.device, dtype=dtype)
        else:
            setattr(part, kind, tensor.to(device=model.device, dtype=torch.float32))
        projection = PROJECTION_OF[module]
        group = [self.parts.get((layer, m)) for m in FUSED_MODULES[projection]]
        if all(p is not None and p.complete(self.static) for p in group):
            self._build(layer, projection, cast(list[Fp8Part], group))

    def _build(self, index: int, projection: str, parts: list[Fp8Part]) -> None:
        layer = cast(DecoderLayer, self.model.layers[index])
        weight, scale, input_scale = fuse_parts(parts)
        bias = layer.projection_bias(projection)
        linears = self.built.setdefault(index, {})
        linears[projection] = Fp8Linear(weight, scale, bias, input_scale, self.dynamic)
        for module in FUSED_MODULES[projection]:
            del self.parts[(index, module)]
        if len(linears) == len(PROJECTIONS):
            layer.quantized = nn.ModuleDict({name: linears[name] for name in PROJECTIONS})

    def check_complete(self) -> None:
        if self.parts:
            part = next(iter(self.parts.values()))
            lacks = "weight" if part.weight is None else (
                "weight_scale" if part.weight_scale is None else "input_scale"
            )  # fmt: skip
            raise ValueError(f"checkpoint is missing {part.name}.{lacks}")
        for i in range(self.model.cfg.num_layers):
            done = self.built.get(i, {})
            for projection, modules in FUSED_MODULES.items():
                if projection not in done:
                    raise ValueError(f"checkpoint is missing model.layers.{i}.{modules[0]}.weight")


@torch.no_grad()
def load_fp8_weights(
    model: LlamaModel, tensors: Iterator[tuple[str, torch.Tensor]], scheme: Fp8Scheme | None
) -> None:
    """Stream a checkpoint into `model` (an `engine.loading.hf_checkpoint.empty_model`): FP8 per
    `scheme`, or dense (None) and quantized here, projection by projection. Sets `model.quantization
    = "fp8"`; raises naming any missing, misshapen or unexpected tensor."""
    static = scheme is not None and not scheme.dynamic_activations
    assembler = _Assembler(model, static, scheme.activation_strategy if scheme else None)
    other: dict[str, Fp8Part] = {}  # an FP8 Linear outside the layers (a head not ignored)
    seen: set[str] = set()
    for name, tensor in tensors:
        m = _PART_TENSOR.match(name)
        if m is not None:
            if m[3].endswith("zero_point"):
                _check_zero(name, tensor)
            else:
                assembler.add(int(m[1]), m[2], m[3], tensor)
            continue
        if _KV_SCALE.match(name):
            continue  # KV scales are calibrated at load (module docstring)
        linear = _OTHER_LINEAR.match(name)
        if linear is not None and (tensor.dtype == FP8_DTYPE or linear[2] != "weight"):
            module, kind = linear[1], linear[2]
            part = other.setdefault(module, Fp8Part(module))
            setattr(part, kind, tensor)
            if part.complete(static=False):
                key = copy_tensor(model, f"{module}.weight", part.dequantized().to(model.dtype))
                seen.update([key] if key else [])
            continue
        key = copy_tensor(model, name, tensor)
        if key is not None:
            seen.add(key)
    assembler.check_complete()
    check_complete_but_projections(model.cfg, seen)
    model.quantization = "fp8"
