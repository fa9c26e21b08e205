"""Write INT8 W8A8 and INT4 W4A16 checkpoints in the compressed-tensors formats
engine/loading/int_checkpoint.py reads (its docstring shows the config keys and tensor names),
as llm-compressor's W8A8 and W4A16 presets lay them out:

    int8  (int-quantized)
        <module>.weight         int8 [out, in]      round(weight / scale), clamped to ±127
        <module>.weight_scale   [out, 1]            amax of each row / 127
    int4  (pack-quantized, group size G, 128 by default)
        <module>.weight_packed  int32 [out, in / 8] round(weight / scale) per group, in
                                                    [-7, 7], packed (pack_int4)
        <module>.weight_scale   [out, in / G]       amax of each group / 7
        <module>.weight_shape   int64 [2]           out, in

Round-to-nearest by default: INT8 activations are dynamic per token (nothing to observe) and
INT4 leaves them in the model dtype; INT4 with `--calibrate` rounds by GPTQ against each
projection's inputs on the bundled corpus instead (deploy/checkpoints/gptq_calibration.py).
Scales divide by 127 and 7 (not compressed-tensors' own 127.5 and 7.5), so each row's or
group's largest weight is stored exactly (round to nearest) and none is clipped; a reader
needs only the stored scales. A scale is stored in the checkpoint's dtype,
and the weight is rounded with the stored scale. Only the decoder's Linear modules are
quantized; the head, embeddings and norms stay dense (`ignore: [lm_head]`).
`pdserve make-model --quantization int8|int4` writes one; `--quantization gptq` writes the
INT4 one in the GPTQ format instead (`gptq_tensors`: the same integers and scales); with
`--from DIR` any of them from a dense checkpoint on disk (`quantize_int_checkpoint`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from deploy.checkpoints.fp8_writer import corpus_ids, popped, write_quantized_copy
from deploy.checkpoints.gptq_calibration import gptq_round, input_hessians
from engine.loading.gptq_checkpoint import SYMMETRIC_ZERO, ZERO_OFFSET
from engine.loading.int_checkpoint import IntScheme
from engine.quantization.int4_linear import INT4_MAX, INT4_MIN, pack_int4
from vocabulary.model_config import ModelConfig

_MIN_SCALE = 1e-12


def quantize_int_tensors(
    tensors: dict[str, torch.Tensor],
    scheme: IntScheme,
    hessians: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint `tensors` (HF names, dense) in `scheme`; INT4 with `hessians` (by module:
    deploy/checkpoints/gptq_calibration.py) rounded by GPTQ, else to nearest. Empties `tensors`
    as it goes (one copy of the weights at a time)."""
    out: dict[str, torch.Tensor] = {}
    for name, t, module in popped(tensors):
        if module is None:
            out[name] = t
            continue
        if scheme.bits == 8:
            q, scale = _quantized(t.float(), 127, -128, 127, t.dtype)
            out[name] = q.to(torch.int8)
            out[f"{module}.weight_scale"] = scale
            continue
        rows, cols = t.shape
        size = scheme.group_size
        if cols % size:
            raise ValueError(f"{name}: {cols} columns are not a multiple of group_size {size}")
        if hessians is not None:
            q, scale = gptq_round(t, hessians[module], size)
        else:
            groups = t.float().reshape(rows * cols // size, size)
            q, scale = _quantized(groups, INT4_MAX, INT4_MIN, INT4_MAX, t.dtype)
        packed, scale = pack_int4(q.reshape(rows, cols)), scale.reshape(rows, cols // size)
        if scheme.source:  # GPTQ: the same integers and scales in its layout
            out |= gptq_tensors(module, packed, scale, size, scheme.source)
            continue
        out[f"{module}.weight_packed"] = packed
        out[f"{module}.weight_scale"] = scale
        out[f"{module}.weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
    return out


def gptq_tensors(
    module: str, packed: torch.Tensor, scale: torch.Tensor, group_size: int, fmt: str
) -> dict[str, torch.Tensor]:
    """A projection's pack-quantized INT4 (`packed` int32 [out, in / 8], `scale` [out,
    in / G]) as a GPTQ checkpoint stores it (engine/loading/gptq_checkpoint.py): qweight
    [in / 8, out], symmetric zero points (8; "gptq" stores 7), scales [in / G, out], g_idx."""
    out, words = packed.shape
    stored = SYMMETRIC_ZERO - ZERO_OFFSET[fmt]
    zeros = torch.full((scale.shape[1], out), stored - 8)  # pack_int4 stores q + 8
    return {
        f"{module}.qweight": packed.t().contiguous(),
        f"{module}.qzeros": pack_int4(zeros),
        f"{module}.scales": scale.t().contiguous(),
        f"{module}.g_idx": (torch.arange(words * 8) // group_size).to(torch.int32),
    }


def _quantized(
    w: torch.Tensor, top: int, lo: int, hi: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int values [rows, cols] in [lo, hi], scales [rows, 1] in `dtype`): each row of the
    float32 `w` by amax / `top`, rounded with the scale as stored."""
    scale = (w.abs().amax(dim=1, keepdim=True) / top).clamp(min=_MIN_SCALE).to(dtype)
    return (w / scale.float()).round().clamp(lo, hi), scale


def check_calibration(scheme: IntScheme | None) -> None:
    """ValueError unless `scheme` quantizes to INT4 (what GPTQ rounding is for)."""
    if scheme is None or scheme.bits != 4:
        raise ValueError("calibrate: GPTQ rounding is for int4 weights (int4 or gptq)")


def quantize_int_checkpoint(
    src: str | Path, out: str | Path, scheme: IntScheme, calibrate: bool = False
) -> Path:
    """Write the dense checkpoint folder `src` to `out` in `scheme` (config.json gains its
    `quantization_config`; tokenizer and other files are copied); INT4 with `calibrate`
    rounded by GPTQ against the first corpus tokens in `src`'s tokenizer."""
    from engine.loading.checkpoint_scheme import read_checkpoint_scheme
    from engine.loading.hf_checkpoint import iter_checkpoint

    src, out = Path(src), Path(out)
    raw = json.loads((src / "config.json").read_text())
    declared = read_checkpoint_scheme(raw)
    if declared is not None:
        raise ValueError(f"{src} is already quantized ({declared}): --from takes a dense one")
    if calibrate:
        check_calibration(scheme)
    tensors = dict(iter_checkpoint(src))
    hessians = None
    if calibrate:
        hessians = input_hessians(tensors, ModelConfig.from_dict(raw), corpus_ids(src))
    quantized = quantize_int_tensors(tensors, scheme, hessians)
    raw["quantization_config"] = scheme.quantization_config()
    return write_quantized_copy(src, out, quantized, raw)
