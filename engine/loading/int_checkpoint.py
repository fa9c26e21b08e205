"""Pre-quantized INT8 (W8A8) and INT4 (W4A16) checkpoints in the compressed-tensors formats
llm-compressor writes, read straight into the model's `Int8Linear` / `Int4Linear` projections.

The two schemes, as config.json and tensor names give them (one config group, targets Linear,
`ignore: [lm_head]`):

    int8   "format": "int-quantized"
           weights            {num_bits: 8, type: int, symmetric: true, strategy: channel}
           input_activations  {num_bits: 8, type: int, symmetric: true, strategy: token,
                               dynamic: true}
           <module>.weight         int8 [out, in]
           <module>.weight_scale   [out, 1]
    int4   "format": "pack-quantized"
           weights            {num_bits: 4, type: int, symmetric: true, strategy: group,
                               group_size: G}
           input_activations  null
           <module>.weight_packed  int32 [out, in / 8]   (engine/quantization/int4_linear.py)
           <module>.weight_scale   [out, in / G]
           <module>.weight_shape   [2]: out, in

Anything else is refused at load, naming the config key and value: another bit width or
type, asymmetric weights (zero points), activation ordering (`actorder`, or a
`weight_g_idx` tensor), static or other activation strategies, INT4 with quantized
activations, a KV-cache scheme, a group size that does not divide the module's columns; and
a missing, misshapen or unexpected tensor (a dense projection among quantized ones: `ignore`
may hold the head only). GPTQ-format INT4 checkpoints (`quant_method: gptq`) are read by
engine/loading/gptq_checkpoint.py into the same `pack-quantized` tensors; AWQ-format ones are
not read: convert them to compressed-tensors (llm-compressor) first.

q/k/v and gate/up are separate modules in the checkpoint and one fused projection here: their
rows are concatenated with their per-row (INT8) or per-row-and-group (INT4) scales, no value
rounded again. Tensor parallelism slices packed words and group scales by whole groups
(engine/tp/tp_shard.py refuses a split inside a group).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from engine.loading.fp8_checkpoint import one_group_config
from engine.loading.hf_checkpoint import (
    PROJECTIONS,
    check_complete_but_projections,
    copy_tensor,
    module_shapes,
)
from engine.modeling.llama import DecoderLayer, LlamaModel
from engine.quantization.int4_linear import Int4Linear
from engine.quantization.int8_linear import Int8Linear
from engine.tp.tp_shard import FUSED_MODULES, LAYER_TENSOR, PROJECTION_OF
from vocabulary.model_config import ModelConfig

INT_QUANTIZED = "int-quantized"
PACK_QUANTIZED = "pack-quantized"
INT_FORMATS = (INT_QUANTIZED, PACK_QUANTIZED)
GPTQ = "gptq"
"""`quant_method` of GPTQ-format checkpoints (AutoGPTQ, GPTQModel)."""
GPTQ_FORMATS = ("gptq", "gptq_v2")
"""Their `checkpoint_format`s: zero points stored as z - 1 (the default) or as z."""

_KINDS = {8: ("weight", "weight_scale"), 4: ("weight_packed", "weight_scale", "weight_shape")}
"""The tensors a module stores, per bit width."""
_REFUSED_KINDS = {
    "weight_zero_point": "asymmetric quantization (a zero point) is not supported",
    "weight_g_idx": "activation ordering (g_idx, actorder) is not supported",
    "input_scale": "static activation scales are not supported (int8 activations are dynamic)",
    "input_zero_point": "asymmetric activations are not supported",
}


@dataclass(frozen=True)
class IntScheme:
    """How a compressed-tensors INT checkpoint quantizes its Linear layers."""

    bits: int
    """8: int8 per-channel weights with dynamic per-token int8 activations (W8A8); 4: int4
    weights per group, activations in the model dtype (W4A16)."""
    group_size: int = 0
    """INT4: input columns per weight scale (0 for INT8: one scale per row)."""
    source: str = ""
    """The checkpoint's layout: "" compressed-tensors; a GPTQ `checkpoint_format` ("gptq",
    "gptq_v2": INT4 only, read through engine/loading/gptq_checkpoint.py)."""

    def __post_init__(self) -> None:
        if self.source not in ("", *GPTQ_FORMATS) or (self.source and self.bits != 4):
            raise ValueError(f"int schemes: source '' or one of {GPTQ_FORMATS} (int4), got "
                             f"{self.source!r}")  # fmt: skip
        if self.bits == 8 and self.group_size != 0:
            raise ValueError("int8 weights have one scale per row (group_size 0)")
        if self.bits == 4 and self.group_size <= 0:
            raise ValueError(f"int4 weights need a group_size > 0, got {self.group_size}")
        if self.bits not in (4, 8):
            raise ValueError(f"int schemes: 8 or 4 bits, got {self.bits}")

    @property
    def name(self) -> str:
        """The weight format (`LlamaModel.quantization`): int8 or int4."""
        return f"int{self.bits}"

    def __str__(self) -> str:
        if self.source:
            return f"GPTQ INT4 W4A16, symmetric, weights per group of {self.group_size}"
        if self.bits == 8:
            return (
                "compressed-tensors INT8 W8A8, per-channel weights, dynamic per-token activations"
            )
        return f"compressed-tensors INT4 W4A16, weights per group of {self.group_size}"

    def quantization_config(self) -> dict[str, Any]:
        """The config.json `quantization_config` of a checkpoint in this scheme (the head
        left dense), as llm-compressor writes its W8A8 and W4A16 presets (GPTQ: as
        AutoGPTQ / GPTQModel write theirs)."""
        if self.source:
            return {
                "quant_method": GPTQ, "bits": 4, "group_size": self.group_size,
                "desc_act": False, "sym": True, "checkpoint_format": self.source,
                "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
            }  # fmt: skip
        base = {"type": "int", "symmetric": True, "observer": "minmax"}
        if self.bits == 8:
            weights = base | {"num_bits": 8, "strategy": "channel", "dynamic": False}
            activations: dict[str, Any] | None = base | {
                "num_bits": 8, "strategy": "token", "dynamic": True, "observer": None,
            }  # fmt: skip
        else:
            weights = base | {"num_bits": 4, "strategy": "group", "group_size": self.group_size,
                              "dynamic": False, "actorder": None}  # fmt: skip
            activations = None
        fmt = INT_QUANTIZED if self.bits == 8 else PACK_QUANTIZED
        return one_group_config(fmt, weights, activations)


def read_int_scheme(qc: Mapping[str, Any], where: str) -> IntScheme:
    """The INT scheme of a compressed-tensors `quantization_config` `qc` whose groups are all
    in an INT format; ValueError naming the key (under `where`) of anything not computed."""
    if qc.get("kv_cache_scheme") is not None:
        raise ValueError(f"{where}.kv_cache_scheme: not supported for int checkpoints")
    groups = cast(Mapping[str, Any], qc["config_groups"])
    schemes = {_group_scheme(qc, g, f"{where}.config_groups.{name}") for name, g in groups.items()}
    if len(schemes) > 1:
        raise ValueError(f"{where}.config_groups: groups disagree ({', '.join(map(str, schemes))})")
    return schemes.pop()


def _group_scheme(qc: Mapping[str, Any], group: Any, where: str) -> IntScheme:
    if not isinstance(group, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {group!r}")
    fmt = group.get("format") or qc.get("format")
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise ValueError(f"{where}.weights: expected the weights' quantization")
    w = f"{where}.weights"
    bits, kind = weights.get("num_bits"), weights.get("type", "int")
    if kind != "int" or bits not in (4, 8):
        raise ValueError(f"{w}: {bits}-bit {kind} is not supported (8-bit or 4-bit int)")
    if not weights.get("symmetric", True):
        raise ValueError(f"{w}.symmetric: false (zero points) is not supported")
    if weights.get("dynamic", False):
        raise ValueError(f"{w}.dynamic: true is not supported (weights are stored)")
    if weights.get("actorder") not in (None, False):
        raise ValueError(f"{w}.actorder: {weights['actorder']!r} is not supported (g_idx)")
    if group.get("output_activations") is not None:
        raise ValueError(f"{where}.output_activations: not supported")
    acts = group.get("input_activations")
    strategy = weights.get("strategy")
    if bits == 8:
        if fmt != INT_QUANTIZED:
            raise ValueError(f"{where}: format {fmt!r} with 8-bit weights is not supported "
                             f"(int8 loads in {INT_QUANTIZED!r})")  # fmt: skip
        if strategy != "channel":
            raise ValueError(f"{w}.strategy: {strategy!r} is not supported for int8 (channel)")
        _check_token_activations(acts, f"{where}.input_activations")
        return IntScheme(8)
    if fmt != PACK_QUANTIZED:
        raise ValueError(f"{where}: format {fmt!r} with 4-bit weights is not supported "
                         f"(int4 loads in {PACK_QUANTIZED!r})")  # fmt: skip
    if strategy != "group":
        raise ValueError(f"{w}.strategy: {strategy!r} is not supported for int4 (group)")
    size = weights.get("group_size")
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"{w}.group_size: {size!r} is not supported (a positive size)")
    if acts is not None:
        raise ValueError(f"{where}.input_activations: int4 with quantized activations is not "
                         "supported (W4A16: null)")  # fmt: skip
    return IntScheme(4, size)


def _check_token_activations(acts: Any, where: str) -> None:
    if not isinstance(acts, Mapping):
        raise ValueError(f"{where}: {acts!r} is not supported (int8 weights need dynamic "
                         "per-token int8 activations)")  # fmt: skip
    bits, kind = acts.get("num_bits"), acts.get("type", "int")
    if kind != "int" or bits != 8:
        raise ValueError(f"{where}: {bits}-bit {kind} is not supported (8-bit int)")
    if not acts.get("symmetric", True):
        raise ValueError(f"{where}.symmetric: false (zero points) is not supported")
    if acts.get("dynamic") is not True or acts.get("strategy") != "token":
        raise ValueError(
            f"{where}: dynamic={acts.get('dynamic')!r} strategy {acts.get('strategy')!r} is "
            "not supported (dynamic per token)"
        )


# ---- assembling fused projections ----------------------------------------------------------


class _Assembler:
    """Collects each layer's module tensors and builds a projection's Int8Linear / Int4Linear
    the moment its last tensor arrives."""

    def __init__(self, model: LlamaModel, whole: ModelConfig, scheme: IntScheme) -> None:
        self.model = model
        self.scheme = scheme
        self.kinds = _KINDS[scheme.bits]
        self.local_shapes = module_shapes(model.cfg)
        self.whole_shapes = module_shapes(whole)
        self.parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self.built: dict[int, dict[str, nn.Module]] = {}

    def add(self, layer: int, module: str, kind: str, tensor: torch.Tensor) -> None:
        name = f"model.layers.{layer}.{module}.{kind}"
        if kind in _REFUSED_KINDS:
            raise ValueError(f"tensor {name}: {_REFUSED_KINDS[kind]}")
        if kind not in self.kinds:
            raise ValueError(
                f"unexpected tensor {name} in an {self.scheme.name} checkpoint (a "
                f"{self.scheme.name} module stores {', '.join(self.kinds)})"
            )
        if layer >= self.model.cfg.num_layers:
            raise ValueError(
                f"tensor {name} is beyond num_hidden_layers={self.model.cfg.num_layers}"
            )
        self._check(name, module, kind, tensor)
        part = self.parts.setdefault((layer, module), {})
        part[kind] = tensor.to(self.model.device)
        projection = PROJECTION_OF[module]
        modules = FUSED_MODULES[projection]
        if all(len(self.parts.get((layer, m), {})) == len(self.kinds) for m in modules):
            self._build(layer, projection, [self.parts.pop((layer, m)) for m in modules])

    def _check(self, name: str, module: str, kind: str, t: torch.Tensor) -> None:
        rows, cols = self.local_shapes[module]
        if kind == "weight_shape":
            want: tuple[int, ...] = self.whole_shapes[module]
            if tuple(int(v) for v in t.reshape(-1).tolist()) != want:
                raise ValueError(f"tensor {name} says {t.tolist()}, config expects {list(want)}")
            return
        if kind == "weight":
            dtype, want = torch.int8, (rows, cols)
        elif kind == "weight_packed":
            dtype, want = torch.int32, (rows, -(-cols // 8))
        else:
            size = self.scheme.group_size
            if size and cols % size:
                raise ValueError(
                    f"{name}: {cols} input columns are not a whole number of groups of {size} "
                    "(quantization_config...weights.group_size)"
                )
            dtype, want = t.dtype, (rows, cols // size if size else 1)
        if t.dtype != dtype or tuple(t.shape) != want:
            raise ValueError(
                f"tensor {name} is {t.dtype} {list(t.shape)}, want {dtype} {list(want)}"
            )

    def _build(self, index: int, projection: str, parts: list[dict[str, torch.Tensor]]) -> None:
        layer = cast(DecoderLayer, self.model.layers[index])
        bias = layer.projection_bias(projection)
        scale = torch.cat([p["weight_scale"].float() for p in parts])
        linear: nn.Module
        if self.scheme.bits == 8:
            linear = Int8Linear(torch.cat([p["weight"] for p in parts]), scale, bias)
        else:
            cols = self.local_shapes[FUSED_MODULES[projection][0]][1]
            packed = torch.cat([p["weight_packed"] for p in parts])
            linear = Int4Linear(packed, scale, cols, self.scheme.group_size, bias)
        linears = self.built.setdefault(index, {})
        linears[projection] = linear
        if len(linears) == len(PROJECTIONS):
            layer.quantized = nn.ModuleDict({name: linears[name] for name in PROJECTIONS})

    def check_complete(self) -> None:
        for (layer, module), part in self.parts.items():
            for kind in (k for k in self.kinds if k not in part):
                raise ValueError(f"checkpoint is missing model.layers.{layer}.{module}.{kind}")
        for i in range(self.model.cfg.num_layers):
            done = self.built.get(i, {})
            for projection, modules in FUSED_MODULES.items():
                if projection not in done:
                    raise ValueError(
                        f"checkpoint is missing model.layers.{i}.{modules[0]}.{self.kinds[0]}"
                    )


@torch.no_grad()
def load_int_weights(
    model: LlamaModel,
    tensors: Iterator[tuple[str, torch.Tensor]],
    scheme: IntScheme,
    whole: ModelConfig | None = None,
) -> None:
    """Stream an INT checkpoint into `model` (an `engine.loading.hf_checkpoint.empty_model`;
    `whole`: the whole model's config when `model` is a TP rank's part). Sets
    `model.quantization` to the scheme's name; raises naming any refused, missing, misshapen
    or unexpected tensor."""
    assembler = _Assembler(model, whole or model.cfg, scheme)
    seen: set[str] = set()
    for name, tensor in tensors:
        m = LAYER_TENSOR.match(name)
        if m is not None:
            if m[2] == "weight" and tensor.is_floating_point():
                raise ValueError(
                    f"tensor {name} is dense ({tensor.dtype}) in an {scheme.name} checkpoint: "
                    "unquantized decoder projections (`ignore` beyond lm_head) are not supported"
                )
            if m[2] != "bias":
                layer = int(name.split(".")[2])
                assembler.add(layer, m[1], m[2], tensor)
                continue
        if not tensor.is_floating_point():
            raise ValueError(
                f"tensor {name} is {tensor.dtype}: only the decoder projections may be "
                "quantized (quantization_config.ignore must hold lm_head)"
            )
        key = copy_tensor(model, name, tensor)
        if key is not None:
            seen.add(key)
    assembler.check_complete()
    check_complete_but_projections(model.cfg, seen)
    model.quantization = scheme.name
