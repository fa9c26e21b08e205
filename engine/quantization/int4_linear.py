"""INT4 W4A16 linear layers: weight-only int4 with one scale per group of input columns,
packed eight to an int32 as compressed-tensors' `pack-quantized` format stores them;
activations stay in the model dtype.

Packing (compressed-tensors `pack_to_int32` with num_bits 4): a value q in [-8, 7] is stored
as q + 8 in four bits; int32 word j of a row holds the row's columns 8j .. 8j+7, column 8j+i
in bits 4i .. 4i+3 (the first column in the lowest bits). A row of `in` columns takes
ceil(in / 8) words. The weight is

    W[n, k] = q[n, k] * weight_scale[n, k // group_size]

(symmetric: no zero point). A call:

    CPU   dequantize W as above in float32, cast to x's dtype, then x @ W.T: what
          transformers + compressed-tensors compute on such a checkpoint (they decompress
          the weight the same way and run the Linear in the model dtype)
    CUDA  `kernels="tinygemm"` (`INT4_KERNELS`), bf16 inputs, group size 32/64/128/256, in
          a multiple of 128 and out of 8:
          PyTorch's tinygemm int4 GEMM (`torch._weight_int4pack_mm`, the weight repacked
          once at load by `_convert_weight_to_int4pack` with scales and zero offsets
          `[groups, out, 2]`, zeros 0); anything else: the CPU path on the device.
          From `large_m_rows` rows on (default `INT4_LARGE_M_ROWS`), W in bf16 is written
          from the repacked weight into a workspace shared by every layer and the bf16
          GEMM runs (engine/quantization/int4_kernels.py: tinygemm's time grows with the
          rows, the dequantize-then-GEMM's barely).
          `kernels="triton"`, bf16 inputs, in a multiple of 128, the group of 16: the weight
          repacked once into engine/quantization/int4_gemm.py's layout, read by its Triton
          GEMM below `large_m_rows` rows (one launch, W dequantized in registers exactly as
          above, float32 accumulation; a row's numbers do not depend on the batch) and by its
          dequantize into the same workspace from there on; where its once-per-device check
          fails, tinygemm.
          Once the repacked weight is made (either one), the device holds only it: the packed
          weight moves to host memory (the dequantized path, for inputs of another dtype, copies
          it back for the call), so an INT4 model takes its int4 bytes of the card once
          (70B: ~35 GB) plus the workspace (its largest projection in bf16: 70B 0.9 GiB)

Figures: none yet (docs/operations.md, "Quantized checkpoints", says which command takes them).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.quantization import int4_gemm, int4_kernels

log = logging.getLogger(__name__)

INT4_MIN, INT4_MAX = -8, 7
PACK = 8
"""int4 values per int32 word."""
TINYGEMM_GROUPS = (32, 64, 128, 256)
_TINYGEMM_INNER_K_TILES = 8
KERNELS = ("triton", "tinygemm")
"""`Int4Linear.kernels`' choices on CUDA (module docstring)."""
INT4_KERNELS = "tinygemm"
"""What a new `Int4Linear` takes on CUDA: the faster in docs/benchmarks.md, "Quantized weights
(INT8, INT4)" (`python -m benchmarks int --int4-kernels triton,tinygemm` times both)."""
INT4_LARGE_M_ROWS = 32
"""Inputs of at least this many rows take the dequantize-then-bf16-GEMM path on CUDA (fewer:
tinygemm). tinygemm's Llama-3-8B decode step on an H100 was 4.17 / 11.8 / 39.1 ms at B=1 /
16 / 64 (the bf16 step 12.75 ms at B=64), dequantizing costs about one bf16 read of the
weights more: the crossover lies between 16 and 64; `python -m benchmarks int --int4-large-m`
measures it (docs/benchmarks.md, "Quantized weights (INT8, INT4)")."""


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int32 [rows, ceil(cols / 8)] of int values q [rows, cols] in [-8, 7] (module
    docstring's layout)."""
    if q.dim() != 2:
        raise ValueError(f"pack_int4: want a 2-D tensor, got {q.dim()}-D")
    if bool((q < INT4_MIN).any() or (q > INT4_MAX).any()):
        raise ValueError("pack_int4: values outside [-8, 7]")
    rows, cols = q.shape
    words = -(-cols // PACK)
    u = torch.zeros((rows, words * PACK), dtype=torch.int64, device=q.device)
    u[:, :cols] = q.to(torch.int64) + 8
    shifts = torch.arange(PACK, device=q.device, dtype=torch.int64) * 4
    packed = (u.view(rows, words, PACK) << shifts).sum(dim=-1)
    # bits 28..31 hold column 8j+7: values above 2^31 wrap to int32's negative range
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int8 [rows, cols] in [-8, 7] of `pack_int4`'s output."""
    rows, words = packed.shape
    if cols > words * PACK or cols <= (words - 1) * PACK:
        raise ValueError(f"unpack_int4: {words} words per row cannot hold {cols} columns")
    shifts = torch.arange(PACK, device=packed.device, dtype=torch.int32) * 4
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.reshape(rows, words * PACK)[:, :cols] - 8).to(torch.int8)


def quantize_groups_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values in [-7, 7] [out, in], float32 scales [out, in / group_size]) of w by
    round-to-nearest per group with scale = amax(|group|) / 7 (the writer's choice: every
    group's largest value is exact; -8 is never used)."""
    out, cols = w.shape
    if cols % group_size:
        raise ValueError(f"in_features {cols} is not a multiple of group_size {group_size}")
    groups = w.float().reshape(out, cols // group_size, group_size)
    scale = (groups.abs().amax(dim=-1, keepdim=True) / INT4_MAX).clamp(
        min=torch.finfo(torch.float32).eps
    )
    q = (groups / scale).round().clamp(INT4_MIN, INT4_MAX).to(torch.int8)
    return q.reshape(out, cols), scale.reshape(out, cols // group_size)


class Int4Linear(torch.nn.Module):
    """`y = x @ W.T + b` with W in packed int4 per group (see the module docstring)."""

    weight_packed: torch.Tensor
    """int32 [out, in / 8] (compressed-tensors' layout)."""
    weight_scale: torch.Tensor
    """float32 [out, in / group_size]."""
    input_scale: torch.Tensor | None = None
    """Always None: activations stay in the model dtype."""

    def __init__(
        self,
        weight_packed: torch.Tensor,
        weight_scale: torch.Tensor,
        in_features: int,
        group_size: int,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        rows = weight_packed.shape[0]
        if weight_packed.dtype != torch.int32 or weight_packed.dim() != 2:
            raise ValueError(f"Int4Linear: want a 2-D int32 weight, got {weight_packed.dtype}")
        if in_features % group_size:
            raise ValueError(
                f"Int4Linear: in_features {in_features} is not a multiple of group_size "
                f"{group_size}"
            )
        if weight_packed.shape[1] != -(-in_features // PACK):
            raise ValueError(
                f"Int4Linear: {weight_packed.shape[1]} packed words per row for "
                f"{in_features} columns"
            )
        want = (rows, in_features // group_size)
        if tuple(weight_scale.shape) != want:
            raise ValueError(
                f"Int4Linear: weight_scale of shape {tuple(weight_scale.shape)}, want {want}"
            )
        self.in_features = in_features
        self.group_size = group_size
        self.register_buffer("weight_packed", weight_packed.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().contiguous())
        self.bias = bias
        self.large_m_rows: int | None = None
        """Rows from which a bf16 input dequantizes W into the workspace (None: the small-M
        kernel at every size; set where the layout check passes, see `INT4_LARGE_M_ROWS`)."""
        self._tinygemm: tuple[torch.Tensor, torch.Tensor] | None = None
        self._interleaved: torch.Tensor | None = None
        """int32 [out, in / 8] in int4_gemm.py's layout (kernels="triton")."""
        if weight_packed.is_cuda:
            self.use_kernels(INT4_KERNELS)

    @property
    def kernels(self) -> str:
        """What a bf16 input runs on CUDA: 'triton', 'tinygemm' or 'dequantize' (neither fits:
        the CPU arithmetic on the device)."""
        if self._interleaved is not None:
            return "triton"
        return "dequantize" if self._tinygemm is None else "tinygemm"

    def use_kernels(self, name: str) -> str:
        """Hold the device copy of the weight that `name` (one of `KERNELS`) reads, in place
        of the one held (the card holds one copy; the packed one lives on the host); returns
        what the layer runs now (`kernels`: 'triton' falls back to tinygemm where its shape or
        its check does not pass). Outside a CUDA-graph capture only."""
        if name not in KERNELS:
            raise ValueError(f"Int4Linear: kernels {name!r}, want one of {KERNELS}")
        device = self.weight_scale.device
        if device.type != "cuda":
            return self.kernels
        rows, cols, group = self.weight_scale.shape[0], self.in_features, self.group_size
        packed = self.weight_packed.to(device)
        self._tinygemm = self._interleaved = None
        self.large_m_rows = None
        if (
            name == "triton"
            and int4_gemm.fits(rows, cols, group)
            and int4_gemm.triton_ready(device)
        ):
            self._interleaved = int4_gemm.interleave(packed, cols)
            int4_gemm.reserve(device, rows, cols)
            int4_kernels.reserve(device, rows * cols)
            self.large_m_rows = INT4_LARGE_M_ROWS
        elif tinygemm_fits(rows, cols, group):
            try:
                self._tinygemm = self._tinygemm_weights(packed)
            except RuntimeError as e:  # a GPU tinygemm was not built for: the CPU arithmetic
                log.warning("int4: PyTorch's int4 GEMM unavailable (%s); dequantizing", e)
            else:
                if int4_kernels.fits(rows, cols) and int4_kernels.layout_verified(device):
                    int4_kernels.reserve(device, rows * cols)
                    self.large_m_rows = INT4_LARGE_M_ROWS
        if self.kernels != "dequantize":  # one copy on the device (module docstring)
            self.weight_packed = self.weight_packed.cpu()
        else:
            self.weight_packed = packed
        return self.kernels

    @property
    def nbytes(self) -> int:
        return self.weight_packed.numel() * 4

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W [out, in] in `dtype` on the scales' device (the module's): the int4 values times
        their group's scale in float32. Where the packed weight lives on the host (module
        docstring) it is copied to the device for the call."""
        packed = self.weight_packed.to(self.weight_scale.device)
        q = unpack_int4(packed, self.in_features).float()
        rows = q.shape[0]
        groups = q.view(rows, -1, self.group_size) * self.weight_scale.unsqueeze(-1)
        return groups.reshape(rows, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W.T + b in `out_dtype` (default x's dtype); x [tokens, in] in a float dtype."""
        out_dtype = out_dtype or x.dtype
        rows = x.shape[0]
        large = self.large_m_rows is not None and rows >= self.large_m_rows
        if self._interleaved is not None and x.dtype == torch.bfloat16 and rows > 0:
            words, scale = self._interleaved, self.weight_scale
            if large:
                w = int4_kernels.workspace(x.device, scale.shape[0], self.in_features)
                out = F.linear(x, int4_gemm.dequantize(words, scale, self.group_size, w))
            else:
                out = int4_gemm.matmul(x, words, scale, self.group_size)
            out = out.to(out_dtype)
            return out if self.bias is None else out + self.bias
        if self._tinygemm is not None and x.dtype == torch.bfloat16 and rows > 0:
            packed, zeros = self._tinygemm
            if large:
                out_features = self.weight_scale.shape[0]
                w = int4_kernels.workspace(x.device, out_features, self.in_features)
                int4_kernels.dequantize(packed, self.weight_scale, self.group_size, w)
                out = F.linear(x, w)
            else:
                out = torch._weight_int4pack_mm(x.contiguous(), packed, self.group_size, zeros)
            out = out.to(out_dtype)
            return out if self.bias is None else out + self.bias
        if rows == 0:  # nothing to compute: no dequantized copy of the weight
            return x.new_empty((0, self.weight_scale.shape[0]), dtype=out_dtype)
        return F.linear(x, self.dequantized(x.dtype), self.bias).to(out_dtype)

    def _tinygemm_weights(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tinygemm's operands from the packed weight on the device: the weight as
        `_convert_weight_to_int4pack` takes it (two unsigned nibbles per byte, the even column
        in the high one: w = (u - 8) * scale + zero), and bf16 scales with zero offsets
        [groups, out, 2]."""
        u = (unpack_int4(packed, self.in_features).to(torch.int32) + 8).to(torch.uint8)
        pairs = (u[:, ::2] << 4 | u[:, 1::2]).contiguous()
        packed = torch._convert_weight_to_int4pack(pairs, _TINYGEMM_INNER_K_TILES)
        scale = self.weight_scale.t().to(torch.bfloat16)
        scales_zeros = torch.stack([scale, torch.zeros_like(scale)], dim=-1).contiguous()
        return packed, scales_zeros


def tinygemm_fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether PyTorch's int4 GEMM takes this shape (module docstring)."""
    return (
        group_size in TINYGEMM_GROUPS
        and in_features % (16 * _TINYGEMM_INNER_K_TILES) == 0
        and out_features % 8 == 0
    )
