"""Choosing a runner's layer ops: availability, a start-up self-check, and the torch fallback.

`create_layer_ops(requested, model)`:
- "torch": `TorchOps`.
- "auto": `FlashInferOps` when the model is fp16/bf16 on CUDA, flashinfer imports and the
  self-check passes; otherwise `TorchOps` (a warning is logged when the fused ops were
  available but failed the check, so a broken kernel costs speed, never correctness).
- "flashinfer": `FlashInferOps`, or `LayerOpsUnavailable` saying why not (no fallback: an
  explicit request is for measuring or testing the fused path).

The self-check runs the model's first layers (its real weights, a few random tokens at random
positions, int32 positions as the runner stages them) once with the reference ops and once
with the candidate, layer by layer from the same inputs, plus the final norm, and compares
every output by relative error (norm of the difference / norm of the reference). An INT8
W8A8 model's projections run in the check with their int8 weights but inputs left unquantized:
the per-token int8 rounding is a step function that turns the fused kernels' bf16 last-bit
differences into whole int8 steps (4-5x the dense model's error on a Llama-3-8B layer, past the
tolerance), and it is the projection's arithmetic, identical on both sides, not the ops'. FP8
keeps its quantized inputs: the fused ops write e4m3 themselves there. Before the check,
the fused kernels are built (JIT, in parallel), which must happen before any CUDA-graph
capture: on a fresh machine that is the slow part of starting a runner (cached afterwards
under FLASHINFER_WORKSPACE_BASE for every later process).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn

from engine.modeling.layer_ops import (
    TORCH_OPS,
    FlashInferOps,
    LayerOps,
    LayerOpsUnavailable,
    fused_ops_unavailable_reason,
)
from engine.modeling.llama import Attend, DecoderLayer, LlamaModel
from engine.quantization.int8_linear import Int8Linear

log = logging.getLogger(__name__)

LAYER_OPS_NAMES = ("auto", "torch", "flashinfer")
SELF_CHECK_TOLERANCE = 2e-2
"""Largest relative error the fused ops may show against torch (bf16 rounding is ~4e-3)."""
FP8_SELF_CHECK_TOLERANCE = 2**-3
"""The same with FP8 projections: a last-bit difference of the fused ops moves some activations
to the next e4m3 value (2^-4 apart, relative), which the next GEMM carries on."""
SELF_CHECK_LAYERS = 2
SELF_CHECK_TOKENS = 7
_CHECK_ROWS = 4096
"""Weight rows an INT8 projection dequantizes at a time in the check (bounded memory)."""


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want32 = want.float()
    return float((got.float() - want32).norm() / want32.norm().clamp_min(1e-30))


def _check_attend(group: int) -> Attend:
    """A cache-free stand-in for attention that still depends on every element of q, k, v (the
    check is about the ops around attention, not attention itself)."""

    def attend(
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        del layer, out_scale
        return q + (k + v).repeat_interleave(group, dim=1)

    return attend


class _Int8UnquantizedInput(nn.Module):
    """An `Int8Linear`'s weight, scales and bias over an input kept in float32 (the check's
    stand-in: see the module docstring)."""

    input_scale: torch.Tensor | None = None
    """None, as `Int8Linear`'s: the op before writes the model dtype."""

    def __init__(self, linear: Int8Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        weight, scale, bias = self.linear.weight, self.linear.weight_scale, self.linear.bias
        xf = x.float()
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)
        for start in range(0, weight.shape[0], _CHECK_ROWS):
            rows = slice(start, start + _CHECK_ROWS)
            out[:, rows] = xf @ (weight[rows].float() * scale[rows, None]).t()
        out = out.to(out_dtype or x.dtype)
        return out if bias is None else out + bias


@contextlib.contextmanager
def _int8_inputs_unquantized(layers: list[DecoderLayer]) -> Iterator[None]:
    """`layers`' INT8 projections with unquantized inputs while open; restored on exit."""
    saved = [(layer, layer.quantized) for layer in layers if layer.quantized is not None]
    try:
        for layer, projections in saved:
            assert projections is not None
            layer.quantized = nn.ModuleDict(
                {
                    name: _Int8UnquantizedInput(p) if isinstance(p, Int8Linear) else p
                    for name, p in projections.items()
                }
            )
        yield
    finally:
        for layer, projections in saved:
            layer.quantized = projections


@torch.inference_mode()
def compare_layer_ops(
    model: LlamaModel,
    ops: LayerOps,
    reference: LayerOps = TORCH_OPS,
    num_layers: int = SELF_CHECK_LAYERS,
    num_tokens: int = SELF_CHECK_TOKENS,
    seed: int = 0,
) -> float:
    """The worst relative error of `ops` against `reference` over the first `num_layers`
    layers of `model` (hidden and residual outputs) and the final norm (see the module
    docstring). Exceptions from `ops` propagate."""
    cfg, device = model.cfg, model.device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,), generator=gen).to(device)
    positions = torch.randint(
        0, cfg.max_position_embeddings, (num_tokens,), generator=gen, dtype=torch.int32
    ).to(device)
    attend = _check_attend(cfg.num_heads // cfg.num_kv_heads)
    h = torch.nn.functional.embedding(ids, model.embed_tokens)
    residual: torch.Tensor | None = None
    worst = 0.0
    layers = [cast(DecoderLayer, layer) for layer in model.layers[:num_layers]]
    with _int8_inputs_unquantized(layers):
        for i, layer in enumerate(layers):
            # the candidate may overwrite its inputs: give it copies of the reference's
            mine = None if residual is None else residual.clone()
            got = layer(i, h.clone(), mine, positions, model.rotary, attend, ops)
            want = layer(i, h, residual, positions, model.rotary, attend, reference)
            worst = max(worst, _rel_err(got[0], want[0]), _rel_err(got[1], want[1]))
            h, residual = want
    final = h if residual is None else residual + h
    got_norm = ops.rms_norm(final, model.norm.weight, model.norm.eps)
    want_norm = reference.rms_norm(final, model.norm.weight, model.norm.eps)
    worst = max(worst, _rel_err(got_norm, want_norm))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return worst


def create_layer_ops(requested: str, model: LlamaModel) -> LayerOps:
    """The layer ops a runner of `model` uses for `requested` (see the module docstring)."""
    if requested not in LAYER_OPS_NAMES:
        raise ValueError(f"unknown layer ops {requested!r}; choose one of {LAYER_OPS_NAMES}")
    if requested == "torch":
        return TORCH_OPS
    reason = fused_ops_unavailable_reason(model.cfg, model.device, model.dtype)
    if reason is not None:
        if requested == "flashinfer":
            raise LayerOpsUnavailable(reason)
        log.debug("layer ops: torch (%s)", reason)
        return TORCH_OPS
    t0 = time.perf_counter()
    try:
        ops = FlashInferOps()
        ops.build_kernels()
        err = compare_layer_ops(model, ops)
    except Exception as e:  # any failure of the optional fused path means "use torch"
        problem = f"{type(e).__name__}: {e}"
    else:
        tolerance = (
            FP8_SELF_CHECK_TOLERANCE if model.quantization == "fp8" else SELF_CHECK_TOLERANCE
        )
        if err < tolerance:  # False for NaN
            log.info(
                "layer ops: flashinfer (self-check relative error %.1e, %.1f s incl. JIT)",
                err,
                time.perf_counter() - t0,
            )
            return ops
        problem = f"relative error {err:.3g} vs torch (tolerance {tolerance:g})"
    if requested == "flashinfer":
        raise LayerOpsUnavailable(f"fused layer ops failed their self-check: {problem}")
    log.warning("fused flashinfer layer ops failed their self-check (%s); using torch", problem)
    return TORCH_OPS
