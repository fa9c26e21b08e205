"""INT8 W8A8 linear layers: int8 weights with one scale per output row (channel), inputs
quantized to int8 at run time with one scale per token, the product accumulated in int32.

This is the scheme of compressed-tensors' `int-quantized` W8A8 checkpoints (llm-compressor's
W8A8, SmoothQuant-style): symmetric int8 both sides, `weight ≈ q_w * weight_scale[row]`,
`x ≈ q_x * x_scale[token]`, so

    y[t, n] = x_scale[t] * weight_scale[n] * sum_k q_x[t, k] * q_w[n, k]   (+ bias)

A token's scale is compressed-tensors' symmetric one: amax(|row|) / 127.5 (its int range
[-128, 127] halved), `q_x = clamp(round(x / scale), -128, 127)` with round-half-even: the
numbers transformers + compressed-tensors compute when it runs such a checkpoint. A request's
numbers never depend on what else is in its batch (every scale is its own token's).

A call:

    CUDA  x → per-token scales and int8 x (torch ops) → `torch._int_mm` (cuBLASLt int8 by
          int8 → int32; it wants more than 16 rows and both dims a multiple of 8: fewer rows
          are padded with zeros to 17; other dims run the CPU arithmetic) → int32 times the
          outer product of the scales, in float32, then the out dtype
          (`kernels="fused"`, where `fused_ready` says so: the same numbers in three
          launches, the quantization into a buffer already padded to 17 rows, `_int_mm`, the
          rescale: engine/quantization/int8_kernels.py;
          `kernels="triton"`, where `triton_ready` says so: the same numbers from one Triton
          GEMM with the rescale in its epilogue, the quantization fused into its prologue for
          decode-sized inputs: engine/quantization/int8_gemm.py)
    CPU   the same quantization of x, `torch._int_mm` on the CPU (exact int32), the same
          rescale: the GPU's numbers exactly (integer sums have no order)

Figures: none yet (docs/operations.md, "Quantized checkpoints", says which command takes them).
"""

from __future__ import annotations

import logging

import torch

from engine.quantization import int8_gemm, int8_kernels
from engine.quantization.fp8_linear import ieee_divide
from engine.quantization.triton_device import DecidedOnce

log = logging.getLogger(__name__)

INT8_MAX = 127.0
HALF_RANGE = 127.5
"""compressed-tensors' symmetric int8 scale divisor: (127 - (-128)) / 2."""
_MIN_SCALE = torch.finfo(torch.float32).eps  # compressed-tensors' stand-in for a zero scale
_INT_MM_MIN_ROWS = 17
KERNELS = ("auto", "triton", "fused", "torch")
"""`Int8Linear.kernels`' choices on CUDA (module docstring); every one gives the same numbers,
so 'auto' may pick by the input's rows without a request's tokens depending on its batch."""
INT8_KERNELS = "auto"
"""What a new `Int8Linear` runs on CUDA: 'auto', the faster of the Triton GEMM and the fused
kernels for the input's rows (`auto_kernels`; `python -m benchmarks int --int8-kernels
auto,triton,fused` times them side by side); a choice whose once-per-device check fails runs
the torch ops."""
TRITON_MAX_DECODE_ROWS = 8
TRITON_MIN_PREFILL_ROWS = 256
"""'auto' runs the Triton GEMM up to the first and from the second row count, the fused
kernels between: on an H100 (docs/benchmarks.md, "Quantized weights (INT8, INT4)") the Triton
GEMM's decode step at B=1 was 0.84x bf16's time against the fused kernels' 0.88x, at B=16 and
64 0.91x / 1.07x against 0.89x / 0.94x; a layer's projections at M = 32-64 took 355 µs against
280, at M = 256 191 against 255, and a 4096-token prefill 0.78x bf16's time against 0.98x
(between 64 and 256 rows not measured yet: `gpu_validate.sh int8x`)."""


def auto_kernels(rows: int) -> str:
    """What 'auto' runs for an input of `rows` rows (`TRITON_MAX_DECODE_ROWS`)."""
    if rows <= TRITON_MAX_DECODE_ROWS or rows >= TRITON_MIN_PREFILL_ROWS:
        return "triton"
    return "fused"


def quantize_rows_int8(
    x: torch.Tensor, divisor: float = HALF_RANGE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [rows, cols], float32 scales [rows, 1]): each row by its own amax / `divisor`,
    rounded half-to-even and clamped to [-128, 127]."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = ieee_divide(amax, divisor).clamp(min=_MIN_SCALE)  # (not amax / divisor: CUDA)
    return (xf / scale).round().clamp(-128, 127).to(torch.int8), scale


class Int8Linear(torch.nn.Module):
    """`y = x @ W.T + b` with W in int8 per channel and x quantized per token (see the module
    docstring)."""

    weight: torch.Tensor
    """int8 [out, in]."""
    weight_scale: torch.Tensor
    """float32 [out]."""
    input_scale: torch.Tensor | None = None
    """Always None: activations are dynamic (the op before never writes int8)."""

    def __init__(
        self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise ValueError(f"Int8Linear: want a 2-D int8 weight, got {weight.dtype}")
        rows = weight.shape[0]
        if weight_scale.numel() != rows:
            raise ValueError(
                f"Int8Linear: weight_scale of {weight_scale.numel()} values for {rows} rows "
                "(want one per row)"
            )
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().reshape(rows).contiguous())
        self.bias = bias
        self._kernels = "torch"
        self.kernels = INT8_KERNELS

    @property
    def kernels(self) -> str:
        """What runs on CUDA, one of `KERNELS` (module docstring); 'triton' and 'fused' only
        where their once-per-device check passes, else the torch ops (the same numbers);
        'auto' picks one of the two by the input's rows (`auto_kernels`)."""
        return self._kernels

    @kernels.setter
    def kernels(self, name: str) -> None:
        if name not in KERNELS:
            raise ValueError(f"Int8Linear: kernels {name!r}, want one of {KERNELS}")
        if name in ("triton", "auto") and self.weight.is_cuda:  # split-K workspace: not in
            # a capture
            int8_gemm.reserve(self.weight.device, self.weight.shape[0])
        self._kernels = name

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W.T + b in `out_dtype` (default x's dtype); x [tokens, in] in a float dtype."""
        out_dtype = out_dtype or x.dtype
        n, k = self.weight.shape
        kernels = auto_kernels(x.shape[0]) if self._kernels == "auto" else self._kernels
        if kernels == "triton" and x.is_cuda and triton_ready(x.device):
            out = int8_gemm.matmul(x, self.weight, self.weight_scale, out_dtype, HALF_RANGE,
                                   _MIN_SCALE)  # fmt: skip
            return out if self.bias is None else out + self.bias
        # (auto: the fused kernels also where the Triton GEMM's check failed)
        fused = self._kernels in ("fused", "auto") and x.is_cuda and not (k % 8 or n % 8)
        if fused and fused_ready(x.device):
            rows = x.shape[0]
            q, scale = int8_kernels.quantize_rows(x, HALF_RANGE, _MIN_SCALE, _INT_MM_MIN_ROWS)
            acc = torch._int_mm(q, self.weight.t())
            out = int8_kernels.rescale(acc, scale, self.weight_scale, rows, out_dtype)
            return out if self.bias is None else out + self.bias
        x_q, x_scale = quantize_rows_int8(x)
        acc = int_matmul(x_q, self.weight)
        out = (acc.float() * x_scale * self.weight_scale).to(out_dtype)
        return out if self.bias is None else out + self.bias


def int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b[N, K].T in exact int32 for int8 a and b."""
    rows, k = a.shape
    n = b.shape[0]
    if rows == 0:
        return torch.zeros((0, n), dtype=torch.int32, device=a.device)
    if a.is_cuda and (k % 8 or n % 8):
        # cuBLASLt's int8 GEMM refuses these; float64 holds every int8 dot product exactly
        return (a.double() @ b.double().t()).to(torch.int32)
    if a.is_cuda and rows < _INT_MM_MIN_ROWS:
        padded = torch.zeros((_INT_MM_MIN_ROWS, k), dtype=torch.int8, device=a.device)
        padded[:rows] = a
        return torch._int_mm(padded, b.t())[:rows]
    return torch._int_mm(a.contiguous(), b.t())


def fused_verified(device: torch.device) -> bool:
    """Whether both kernels give the torch ops' numbers on `device` (once per device, on a
    probe with exact ties, a zero row and a width that is no power of two)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3000, generator=gen)
    x[1] = 0.0
    x[2, :4] = torch.tensor([127.5, 0.5, 1.5, -2.5])  # scale 1: the values tie at .5
    x[2, 4:] = 0.25
    acc = torch.randint(-(2**24), 2**24, (_INT_MM_MIN_ROWS, 96), generator=gen, dtype=torch.int32)
    ws = torch.rand(96, generator=gen) + 0.5
    try:
        want_q, want_s = quantize_rows_int8(x.to(torch.bfloat16))
        got_q, got_s = int8_kernels.quantize_rows(
            x.to(torch.bfloat16).to(device), HALF_RANGE, _MIN_SCALE, _INT_MM_MIN_ROWS
        )
        want = (acc[:5].float() * want_s * ws).to(torch.bfloat16)
        got = int8_kernels.rescale(
            acc.to(device), want_s.to(device), ws.to(device), 5, torch.bfloat16
        )
        same = (
            torch.equal(got_q[:5].cpu(), want_q)
            and not got_q[5:].any().item()
            and torch.equal(got_s.cpu(), want_s)
            and torch.equal(got.cpu(), want)
        )
    except Exception as e:  # a kernel that does not build here
        log.warning("int8: no fused kernels (%s: %s); torch ops", type(e).__name__, e)
        return False
    if not same:
        log.warning("int8: the fused kernels differ from the torch ops here; torch ops")
    return same


def triton_verified(device: torch.device) -> bool:
    """Whether the int8 GEMM gives the torch ops' numbers on `device`, bit for bit, in every
    bucket's config, split-K and the fused quantization included (once per device, on a probe
    with exact ties, a zero row and widths that are no multiple of a tile)."""
    gen = torch.Generator().manual_seed(0)
    n, k = 200, 1064
    x = torch.randn(300, k, generator=gen)
    x[1] = 0.0
    x[2, :4] = torch.tensor([127.5, 0.5, 1.5, -2.5])  # scale 1: the values tie at .5
    x[2, 4:] = 0.25
    x[3] *= 1000.0
    w, ws = quantize_rows_int8(torch.randn(n, k, generator=gen), INT8_MAX)
    try:
        int8_gemm.reserve(device, n)
        dev_w, dev_ws = w.to(device), ws.reshape(n).to(device)
        for rows in (1, 5, 17, 80, 300):  # every bucket
            xb = x[:rows].to(torch.bfloat16)
            for dtype in (torch.bfloat16, torch.float32):
                want_q, want_s = quantize_rows_int8(xb)
                want = (int_matmul(want_q, w).float() * want_s * ws.reshape(n)).to(dtype)
                got = int8_gemm.matmul(xb.to(device), dev_w, dev_ws, dtype, HALF_RANGE, _MIN_SCALE)
                if not torch.equal(got.cpu(), want):
                    log.warning("int8: the Triton GEMM differs from the torch ops here (%d rows,"
                                " %s); torch ops", rows, dtype)  # fmt: skip
                    return False
    except Exception as e:  # a kernel that does not build here
        log.warning("int8: no Triton GEMM (%s: %s); torch ops", type(e).__name__, e)
        return False
    return True


fused_ready = DecidedOnce(
    lambda device: int8_kernels.unavailable_reason(device) is None and fused_verified(device)
)
"""Whether `Int8Linear` may run engine/quantization/int8_kernels.py on a device (`DecidedOnce`)."""
triton_ready = DecidedOnce(
    lambda device: int8_gemm.unavailable_reason(device) is None and triton_verified(device)
)
"""Whether `Int8Linear` may run engine/quantization/int8_gemm.py on a device (`DecidedOnce`)."""
