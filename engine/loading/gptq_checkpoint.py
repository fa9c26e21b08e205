"""GPTQ-format INT4 checkpoints (AutoGPTQ, GPTQModel: `quant_method: gptq`), read as the
compressed-tensors `pack-quantized` INT4 W4A16 they equal (engine/loading/int_checkpoint.py).

config.json `quantization_config`, what loads:

    {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": false, "sym": true,
     "checkpoint_format": "gptq" (the default) or "gptq_v2", ...}

and per decoder projection (`<module>` = model.layers.N.self_attn.q_proj, ...):

    <module>.qweight  int32 [in / 8, out]  word i of column n: rows 8i .. 8i+7, row 8i+j in
                                           bits 4j .. 4j+3, unsigned u in [0, 15]
    <module>.qzeros   int32 [in / G, out / 8]  zero points packed along the columns; "gptq"
                                           stores z - 1, "gptq_v2" z; symmetric 4-bit: z = 8
    <module>.scales   [in / G, out]        one scale per group and column (fp16 as written)
    <module>.g_idx    int32 [in]           the group of each input row (optional)
    <module>.bias     [out]                (optional)

    W[n, k] = scales[k // G, n] * (u[k, n] - z)

With z = 8 that is pack-quantized's W[n, k] = weight_scale[n, k // G] * q[n, k] with
q = u - 8 stored as u in the same nibble order, so the conversion moves no bit: weight_packed =
qweight transposed, weight_scale = scales transposed (values unchanged), weight_shape = [out, in].
The same numbers as the pack-quantized checkpoint of those integers and scales, whatever kernel
runs them.

Refused, naming the key or tensor: another bit width, `desc_act: true` or a `g_idx` that is not
`k // G` (activation ordering), `sym: false` or any zero point other than 8 (asymmetric),
`group_size` -1 (one group per row) or one that does not divide a module's rows, an unknown
`checkpoint_format`, a missing or misshapen tensor. A tensor-parallel rank reads the whole
tensors and cuts the converted ones (engine/loading/loaders.py `LoadSpec.tensors`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from engine.loading.int_checkpoint import GPTQ, GPTQ_FORMATS, IntScheme
from engine.quantization.int4_linear import unpack_int4
from engine.tp.tp_shard import LAYER_TENSOR

WHERE = "config.json: quantization_config"
ZERO_OFFSET = dict(zip(GPTQ_FORMATS, (1, 0), strict=True))
"""`checkpoint_format` → what is added to a stored zero point to get z."""
SYMMETRIC_ZERO = 8
_KINDS = ("qweight", "qzeros", "scales")
_OPTIONAL = ("g_idx",)


def is_gptq(raw_config: Mapping[str, Any]) -> bool:
    """Whether config.json declares a GPTQ checkpoint."""
    qc = raw_config.get("quantization_config")
    return isinstance(qc, Mapping) and qc.get("quant_method") == GPTQ


def read_gptq_scheme(raw_config: Mapping[str, Any]) -> IntScheme:
    """The INT4 scheme of a GPTQ config.json; ValueError naming the key of what is not
    computed (module docstring)."""
    qc = raw_config["quantization_config"]
    bits = qc.get("bits")
    if bits != 4:
        raise ValueError(f"{WHERE}.bits: {bits!r} is not supported (GPTQ loads 4-bit weights)")
    if qc.get("desc_act"):
        raise ValueError(f"{WHERE}.desc_act: true (activation ordering) is not supported")
    if qc.get("sym") is False:
        raise ValueError(f"{WHERE}.sym: false (zero points) is not supported")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"{WHERE}.checkpoint_format: {fmt!r} is not supported "
                         f"({', '.join(GPTQ_FORMATS)})")  # fmt: skip
    size = qc.get("group_size")
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"{WHERE}.group_size: {size!r} is not supported (a positive size; -1, "
                         "one group per row, is not)")  # fmt: skip
    return IntScheme(4, size, source=fmt)


def pack_quantized_tensors(
    tensors: Iterator[tuple[str, torch.Tensor]], scheme: IntScheme
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each decoder projection's GPTQ tensors turned into
    `weight_packed`, `weight_scale` and `weight_shape` (module docstring), every other tensor
    as it is; ValueError naming a tensor that is refused, misshapen or missing."""
    offset = ZERO_OFFSET[scheme.source]
    parts: dict[str, dict[str, torch.Tensor]] = {}
    converted: dict[str, int] = {}  # module -> its input rows, for a g_idx that comes later
    for name, tensor in tensors:
        m = LAYER_TENSOR.match(name)
        module, _, kind = name.rpartition(".")
        if m is None or kind not in _KINDS + _OPTIONAL:
            if kind == "weight" and m is not None and not tensor.is_floating_point():
                raise ValueError(f"tensor {name}: int weights in a GPTQ checkpoint (qweight)")
            yield name, tensor
            continue
        if kind == "g_idx" and module in converted:
            _check_g_idx(module, tensor, converted[module], scheme.group_size)
            continue
        part = parts.setdefault(module, {})
        part[kind] = tensor
        if all(k in part for k in _KINDS):
            converted[module] = part["qweight"].shape[0] * 8
            yield from _converted(module, parts.pop(module), scheme, offset)
    for module, part in parts.items():
        missing = next(k for k in _KINDS if k not in part)
        raise ValueError(f"checkpoint is missing {module}.{missing}")


def _converted(
    module: str, part: dict[str, torch.Tensor], scheme: IntScheme, offset: int
) -> Iterator[tuple[str, torch.Tensor]]:
    qweight, qzeros, scales = part["qweight"], part["qzeros"], part["scales"]
    size = scheme.group_size
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"tensor {module}.qweight is {qweight.dtype} {list(qweight.shape)}, "
                         "want int32 [in / 8, out]")  # fmt: skip
    rows, out = qweight.shape[0] * 8, qweight.shape[1]
    if rows % size:
        raise ValueError(f"{module}: {rows} input rows are not a whole number of groups of "
                         f"{size} ({WHERE}.group_size)")  # fmt: skip
    groups = rows // size
    if tuple(scales.shape) != (groups, out) or not scales.is_floating_point():
        raise ValueError(f"tensor {module}.scales is {scales.dtype} {list(scales.shape)}, "
                         f"want a float [{groups}, {out}]")  # fmt: skip
    if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, -(-out // 8)):
        raise ValueError(f"tensor {module}.qzeros is {qzeros.dtype} {list(qzeros.shape)}, "
                         f"want int32 [{groups}, {-(-out // 8)}]")  # fmt: skip
    zeros = unpack_int4(qzeros, out).long() + 8 + offset  # the stored nibbles (q + 8), + offset
    if bool((zeros != SYMMETRIC_ZERO).any()):
        bad = int(zeros[zeros != SYMMETRIC_ZERO][0])
        raise ValueError(f"tensor {module}.qzeros: a zero point of {bad}: asymmetric "
                         f"weights are not supported (symmetric: {SYMMETRIC_ZERO})")  # fmt: skip
    if "g_idx" in part:
        _check_g_idx(module, part["g_idx"], rows, size)
    yield f"{module}.weight_packed", qweight.t().contiguous()
    yield f"{module}.weight_scale", scales.t().contiguous()
    yield f"{module}.weight_shape", torch.tensor([out, rows], dtype=torch.int64)


def _check_g_idx(module: str, g_idx: torch.Tensor, rows: int, size: int) -> None:
    want = torch.arange(rows, dtype=torch.int64) // size
    if tuple(g_idx.shape) != (rows,) or not torch.equal(g_idx.long().cpu(), want):
        raise ValueError(f"tensor {module}.g_idx: not each row's k // {size} (activation "
                         "ordering is not supported)")  # fmt: skip
