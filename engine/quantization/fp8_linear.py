"""FP8 (e4m3) linear layers: weights in FP8 with one scale per tensor or one per output row
(channel), activations quantized as the checkpoint declares, the GEMM on cuBLASLt
(`torch._scaled_mm`).

`Fp8Linear.from_weight` quantizes a bf16/fp32 weight `[out, in]` to e4m3 with the scale
`amax / 448` (448 is e4m3's largest finite value), so `weight ≈ q * scale`. Activations, one of:

    static      one `input_scale` known before the step (the checkpoint's, or calibrated at
                load: engine/loading/fp8_calibration.py): the op before the GEMM can write e4m3
                itself (the fused path), and every request shares that scale
    token       dynamic per token: each row of x gets amax(|row|) / 448, so a request's
                numbers never depend on what else is in its batch (the scheme most FP8 Llama
                checkpoints declare)
    tensor      dynamic per tensor: one amax over the whole input (the batch shares it)
    none        weights only: the input stays in its dtype and meets the weight dequantized
                (what a checkpoint without input activations declares; correct, not fast)

A call:

    CUDA  x → its scale(s) on the device (no host sync, graph-safe) → x_q = (x / scale) in
          e4m3 → _scaled_mm(x_q, q.T, ...): per-tensor scales on both sides run tensor-wise
          (cuBLASLt's fastest); a per-token or per-channel side runs row-wise (scales [M, 1]
          and [1, N], bf16 out; another out dtype computes it as CPU does)
    CPU   the same quantization of x, then a float matmul with the dequantized weight: the
          numbers the GPU path computes up to its accumulation order (used by correctness
          tests on the tiny model; CPU has no FP8 GEMM)

Figures: docs/benchmarks.md, "FP8 weights and e4m3 KV".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_SCALE = 1e-12  # an all-zero tensor still gets a usable scale


def ieee_divide(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """`t / divisor` as the IEEE quotient on every device: on CUDA torch divides a tensor by
    a Python-float scalar as a times the scalar's reciprocal, a bit off the quotient the CPU,
    the kernels and compressed-tensors' CPU emulation compute (the INT8 GPU tests caught it);
    divided by a tensor it is exact."""
    return t / torch.full_like(t, divisor)


def quantize_per_tensor(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 tensor, float32 scale of shape []) with t ≈ q.float() * scale."""
    scale = ieee_divide(t.detach().abs().amax().float(), FP8_MAX).clamp(min=_MIN_SCALE)
    q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


ACTIVATIONS = ("static", "token", "tensor", "none")
"""How an Fp8Linear quantizes its input (the module docstring)."""


class Fp8Linear(torch.nn.Module):
    """`y = x @ W.T + b` with W in e4m3 (see the module docstring)."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    """float32, [] (per tensor) or [out] (per channel)."""
    input_scale: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        input_scale: torch.Tensor | None = None,
        dynamic: str | None = None,
    ) -> None:
        """`input_scale`: a static per-tensor activation scale (from the checkpoint or
        calibrated at load); without one, each input is quantized at run time per `dynamic`,
        what a checkpoint declares: "token" (a scale per row) or "tensor" (one amax over the
        input); None (nothing declared: pdserve's own scheme) is per tensor until load
        calibrates a static scale; "none" (weights only) leaves the input in its dtype."""
        super().__init__()
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"Fp8Linear: want a 2-D {FP8_DTYPE} weight, got {weight.dtype}")
        if dynamic not in (None, "token", "tensor", "none"):
            raise ValueError(f"Fp8Linear: dynamic: token, tensor or none, got {dynamic!r}")
        out_features, in_features = weight.shape
        if weight.is_cuda and (in_features % 16 or out_features % 16):
            shape = tuple(weight.shape)
            raise ValueError(f"Fp8Linear: cuBLASLt FP8 needs dims divisible by 16, got {shape}")
        scale = weight_scale.float()
        if scale.numel() == 1:
            scale = scale.reshape(())
        elif scale.numel() == out_features:
            scale = scale.reshape(out_features).contiguous()
        else:
            raise ValueError(
                f"Fp8Linear: weight_scale of {scale.numel()} values for {out_features} rows "
                "(want one, or one per row)"
            )
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        self.bias = bias
        self.dynamic = dynamic
        self.register_buffer(
            "input_scale", None if input_scale is None else input_scale.float().reshape(())
        )

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Fp8Linear:
        q, scale = quantize_per_tensor(weight)
        return cls(q, scale, bias)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    @property
    def is_static(self) -> bool:
        """Whether inputs are quantized with the fixed `input_scale` (the fused-op path)."""
        return self.input_scale is not None

    @property
    def activations(self) -> str:
        """One of `ACTIVATIONS`: what a call does to its input."""
        return "static" if self.input_scale is not None else self.dynamic or "tensor"

    @property
    def per_channel(self) -> bool:
        return self.weight_scale.dim() == 1

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        scale = self.weight_scale[:, None] if self.per_channel else self.weight_scale
        return (self.weight.float() * scale).to(dtype)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x in e4m3, its scale: [] static or per tensor, [rows, 1] per token)."""
        if self.input_scale is not None:
            return quantize_static(x, self.input_scale), self.input_scale
        if self.dynamic == "token":
            return quantize_per_token(x)
        # one reduction for the scale; x / scale stays in x's dtype (a 0-dim float32 tensor
        # does not promote it), e4m3 saturates in the clamp
        amax = torch.linalg.vector_norm(x, ord=float("inf")).float()
        x_scale = ieee_divide(amax, FP8_MAX).clamp(min=_MIN_SCALE)
        return (x / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), x_scale

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W.T + b in `out_dtype` (default x's dtype). An e4m3 `x` is taken as already
        quantized with `input_scale` (a fused norm/activation wrote it) and needs out_dtype."""
        if self.activations == "none" and x.dtype != FP8_DTYPE:
            return F.linear(x, self.dequantized(out_dtype or x.dtype), self.bias)
        if x.dtype == FP8_DTYPE:
            if self.input_scale is None or out_dtype is None:
                raise ValueError("an e4m3 input needs a static input_scale and an out_dtype")
            x_q, x_scale = x, self.input_scale
        else:
            out_dtype = out_dtype or x.dtype
            x_q, x_scale = self.quantize_input(x)
        rowwise = x_scale.dim() > 0 or self.per_channel
        if x_q.is_cuda and not rowwise:
            return torch._scaled_mm(
                x_q,
                self.weight.t(),
                scale_a=x_scale,
                scale_b=self.weight_scale,
                bias=self.bias,
                out_dtype=out_dtype,
            )
        if x_q.is_cuda and out_dtype == torch.bfloat16:
            rows, cols = x_q.shape[0], self.weight.shape[0]
            out = torch._scaled_mm(
                x_q,
                self.weight.t(),
                scale_a=x_scale.expand(rows, 1).contiguous(),
                scale_b=self.weight_scale.expand(1, cols).contiguous(),
                out_dtype=out_dtype,
            )
            return out if self.bias is None else out + self.bias
        x_dq = (x_q.float() * x_scale).to(out_dtype)
        return F.linear(x_dq, self.dequantized(out_dtype), self.bias)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in e4m3, float32 scales [rows, 1]): each row of x [rows, cols] by its own amax."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = ieee_divide(amax, FP8_MAX).clamp(min=_MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale in e4m3, saturated at ±448 (the reference the fused kernels are checked
    against; computed in float32)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def pow2_scale(amax: float, headroom: float) -> float:
    """The smallest power of two >= amax * headroom / 448 (a scale whose division is exact in
    any float format, and which equal models calibrate to bit-identically)."""
    want = max(amax * headroom / FP8_MAX, _MIN_SCALE)
    return float(2.0 ** math.ceil(math.log2(want)))
