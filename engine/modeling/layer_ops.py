"""The decoder layer's elementwise ops behind one small interface: torch math or fused kernels.

Between its matmuls a Llama layer normalizes, adds the residual, rotates q/k and gates the MLP.
In plain torch that is 34 small kernels per layer besides its 4 matmuls and attention (an fp32
RMSNorm alone is 8: cast, pow, mean, add, rsqrt, mul, cast, mul; RoPE 14), which inside a
CUDA-graph decode step cost about as much as the step's HBM traffic. `LayerOps` names the four
things the model needs, and each implementation does them its own way:

- `TorchOps`: the reference math (transformers numerics: RMSNorm in float32, rotate-half RoPE
  with the float32 cos/sin tables cast to the activation dtype). Any device and dtype,
  functional (autograd works: training uses it), and bit-for-bit the model's math before this
  interface existed. CPU always runs it.
- `FlashInferOps`: flashinfer's fused CUDA kernels, one launch per op: `rmsnorm`,
  `fused_add_rmsnorm`, `apply_rope_with_cos_sin_cache_inplace` (NeoX / rotate-half style)
  and `silu_and_mul`: 4 small kernels per layer instead of 34. fp16/bf16 on CUDA only;
  results differ from torch by bf16 rounding (the fused kernels round once, in float32).

Contract of every implementation (the model relies on it; tests check both):
- `rms_norm(x, w, eps)` returns a new tensor and leaves x alone; x is [T, H] or [T, heads, D]
  with a contiguous last dimension (other strides are fine).
- `add_rms_norm(x, residual, w, eps)` returns (rmsnorm(x + residual), x + residual). It MAY
  overwrite x and residual with those results (flashinfer does), so the caller must own both
  and use only the returned pair afterwards.
- `rope(positions, q, k, tables)` returns rotated (q, k); q [T, Hq, D] and k [T, Hkv, D] may be
  strided views of the fused qkv projection. It MAY rotate them in place (flashinfer does).
- `silu_and_mul(x)` returns silu(x[..., :I]) * x[..., I:] for x [..., 2I] (contiguous).

Choosing the ops for a runner (availability, self-check, fallback) is
engine/modeling/layer_ops_select.py.
"""

from __future__ import annotations

import abc
import functools
import importlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from engine.quantization.fp8_linear import FP8_DTYPE, quantize_static
from vocabulary.model_config import ModelConfig

log = logging.getLogger(__name__)

FUSED_HEAD_DIMS = (64, 128, 256, 512)
"""Head dims flashinfer's RoPE kernel is compiled for."""


class LayerOpsUnavailable(RuntimeError):
    """The requested layer ops cannot run here (no CUDA, wrong dtype, missing package, or the
    fused kernels failed their self-check)."""


class RopeTables(Protocol):
    """The model's RoPE tables for positions [0, max_position_embeddings), all float32."""

    cos: torch.Tensor
    """[max_pos, D]: cos of cat(freqs, freqs) (the rotate-half layout transformers uses)."""
    sin: torch.Tensor
    """[max_pos, D]: sin of cat(freqs, freqs)."""
    cos_sin_cache: torch.Tensor
    """[max_pos, D], contiguous: cos(freqs) in the first half, sin(freqs) in the second
    (flashinfer's cos/sin cache layout)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: in float32, cast back, then scaled by weight."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LayerOps(abc.ABC):
    """Norm, residual, RoPE and gated-activation ops of the decoder layer (see the module
    docstring for the contract, including which arguments an implementation may overwrite)."""

    name: ClassVar[str]

    @abc.abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension; x is not modified."""

    @abc.abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual), x + residual); may overwrite x and residual."""

    @abc.abstractmethod
    def rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, tables: RopeTables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE of q [T, Hq, D] and k [T, Hkv, D] at positions [T]; may be in place."""

    @abc.abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x[..., :I]) * x[..., I:] for x [..., 2I]."""

    # FP8 inputs of the next GEMM (static per-tensor scale: a float32 0-dim device tensor).
    # These compose the ops above with a separate cast; fused implementations override them.

    def quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x / scale in e4m3, saturated (x [T, N])."""
        return quantize_static(x, scale)

    def rms_norm_quant(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor
    ) -> torch.Tensor:
        """rms_norm(x) / scale in e4m3; x is not modified."""
        return self.quantize(self.rms_norm(x, weight, eps), scale)

    def add_rms_norm_quant(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        scale: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual) / scale in e4m3, x + residual); may overwrite residual and x."""
        h, summed = self.add_rms_norm(x, residual, weight, eps)
        return self.quantize(h, scale), summed

    def silu_and_mul_quant(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """silu_and_mul(x) / scale in e4m3."""
        return self.quantize(self.silu_and_mul(x), scale)


class TorchOps(LayerOps):
    """The reference: plain torch, functional, transformers-exact in float32."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = residual + x
        return rms_norm(summed, weight, eps), summed

    def rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, tables: RopeTables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = tables.cos[positions].to(q.dtype).unsqueeze(1)
        sin = tables.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


TORCH_OPS = TorchOps()
"""The one TorchOps instance (it has no state): the model's default."""


def fused_ops_unavailable_reason(
    model_cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> str | None:
    """Why FlashInferOps cannot run this model here, or None when it can (before the
    self-check, which only the selection runs)."""
    if device.type != "cuda":
        return f"fused layer ops need a CUDA device (got {device})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"fused layer ops run in float16/bfloat16 (got {dtype})"
    if model_cfg.head_dim not in FUSED_HEAD_DIMS:
        return f"flashinfer RoPE supports head_dim {FUSED_HEAD_DIMS} (got {model_cfg.head_dim})"
    try:
        _import_flashinfer_ops()
    except Exception as e:  # an optional extra: any import failure means "not here"
        return f"flashinfer does not import: {e}"
    return None


def _import_flashinfer_ops() -> tuple[ModuleType, ModuleType, ModuleType]:
    return (
        importlib.import_module("flashinfer.norm"),
        importlib.import_module("flashinfer.rope"),
        importlib.import_module("flashinfer.activation"),
    )


class FlashInferOps(LayerOps):
    """flashinfer 0.7.4's fused kernels, one launch per op (in place where the contract allows).

    Every call launches kernels on the current stream without host syncs or host-side
    allocation, so the ops are safe inside CUDA-graph capture. The kernels compile (JIT) on
    their first call: make it outside a capture (the runner's self-check does).
    """

    name = "flashinfer"

    def __init__(self) -> None:
        try:
            self._norm, self._rope, self._act = _import_flashinfer_ops()
        except Exception as e:
            raise LayerOpsUnavailable(f"flashinfer does not import: {e}") from e
        from engine.quantization import fp8_kernels

        reason = fp8_kernels.unavailable_reason()
        if reason is not None:
            log.debug("fused FP8 casts: composed ops (%s)", reason)
        self._fp8_kernels: ModuleType | None = fp8_kernels if reason is None else None

    def build_kernels(self) -> None:
        """Build (JIT) or load the kernels' modules in parallel threads. On a fresh machine
        norm and RoPE take a minute or two each (rope.cu: ~105 s of one CPU core), and first use
        would build them one after another; afterwards they load from the JIT cache under
        FLASHINFER_WORKSPACE_BASE in any process. Best effort: a module that fails to build
        here fails again, with its error, on first use (the self-check's)."""
        builders: list[Callable[[], object]] = []
        for module, name, args in (
            (self._norm, "get_norm_module", ()),
            (self._rope, "get_rope_module", ()),
            (self._act, "get_act_and_mul_module", ("silu",)),
        ):
            fn = getattr(module, name, None)  # flashinfer internals: absent is fine
            if callable(fn):
                builders.append(functools.partial(fn, *args))
        if not builders:
            return
        with ThreadPoolExecutor(len(builders), thread_name_prefix="flashinfer-jit") as pool:
            for future in [pool.submit(b) for b in builders]:
                try:
                    future.result()
                except Exception as e:
                    log.warning("building a flashinfer layer-ops module failed: %s", e)

    # The kernels fail on zero rows (cudaErrorInvalidValue, left pending for the next launch):
    # an empty input returns at once.

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.empty_like(x)
        out: torch.Tensor = self._norm.rmsnorm(x, weight, eps)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # residual += x; x = rmsnorm(residual) * weight, in one kernel
        if x.shape[0] > 0:
            self._norm.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual

    def rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, tables: RopeTables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # flashinfer takes [T, heads * D] (any row stride, contiguous heads) and int32/int64
        # positions; it rotates q and k in the buffers they view (here: the qkv projection).
        t, d = q.shape[0], q.shape[-1]
        if t == 0:
            return q, k
        self._rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q.view(t, -1), k.view(t, -1), d, tables.cos_sin_cache, is_neox=True
        )
        return q, k

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, x.shape[-1] // 2))
        out: torch.Tensor = self._act.silu_and_mul(x.contiguous())
        return out

    # FP8: flashinfer's norm kernels write e4m3 themselves; SiLU·mul and the plain cast are
    # triton kernels (engine/quantization/fp8_kernels.py) when triton runs here, else the composed
    # ops.

    def quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self._fp8_kernels is None or x.dim() != 2 or x.stride(-1) != 1:
            return super().quantize(x, scale)
        out: torch.Tensor = self._fp8_kernels.quantize(x, scale)
        return out

    def rms_norm_quant(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor
    ) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
        if x.shape[0] > 0:
            self._norm.rmsnorm_quant(out, x, weight, scale.reshape(1), eps)
        return out

    def add_rms_norm_quant(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        scale: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # residual += x; out = rmsnorm(residual) * weight / scale in e4m3, in one kernel
        out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
        if x.shape[0] > 0:
            self._norm.fused_add_rmsnorm_quant(out, x, residual, weight, scale.reshape(1), eps)
        return out, residual

    def silu_and_mul_quant(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self._fp8_kernels is None or x.stride(-1) != 1:
            return super().silu_and_mul_quant(x, scale)
        out: torch.Tensor = self._fp8_kernels.silu_and_mul_quant(x, scale)
        return out
