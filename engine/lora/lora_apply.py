"""Batched LoRA on the fused projections: one step mixes adapters and the base model.

Every token of a step reads one device slot (`LoraWeights`) or none (-1: the base model). For
each fused projection an adapter targets (qkv, o, gate_up, down) the model adds, per token t
with slot s,

    out[t, part] += (x[t] @ A[s, part]^T) @ B[s, part]        (B holds the scaling already)

to the base projection's output, part by part (q, k, v of qkv; gate, up of gate_up). Four
ways to compute it, all behind `LoraStep.add`:

- grouped (`eager_step`): the runner knows the slots on the host, so it loops over the
  distinct slots of the step (a slice when a slot's tokens are one run, else an index
  gather/scatter) at each adapter's own rank and only over the modules it targets; base
  tokens cost nothing. Any device; every eager step (prefill, mixed steps), and the
  reference the other three are tested against.
- BGMV (`graph_step`, kernel "triton", engine/lora/lora_triton.py): per token, that token's slot,
  in two Triton launches per fused projection covering all its parts (a shrink into fp32
  partial sums, an expand adding in place into the base output): 8 launches a layer, no
  mask, and base tokens read no weights (nor does a slot no token reads, so an upload in
  flight is never seen). Shapes fixed by the batch and the model, so CUDA graphs hold for
  any slots. CUDA (or Triton's interpreter on CPU, for tests). Its default path is "dot"
  (engine/lora/lora_dot.py: the dense cuBLAS shrink, then one tensor-core expand per projection
  that reads every slot's B once per tile of tokens and masks the token's other slots in
  registers), which "auto" picks on CUDA. On CUDA its shrink runs on a side stream beside
  the base projection (`LoraStep.begin`; a parallel branch in a CUDA graph): 1.065x the base
  step at 4 adapters in 4 slots on the H200, 1.159x with the shrink in line (the per-token
  BGMV expands: 1.46x).
- dense (`graph_step`, kernel "torch"): shapes that do not depend on the slots, for CUDA
  graphs: x times every slot's A at once (one matmul), zeroed outside each token's slot by a
  one-hot mask, then one matmul per part into its output columns (`addmm_`, no copies). It
  reads every slot's weights once per step whatever the batch (max_loras x max_lora_rank x
  (in + out) per projection), never a per-token copy of them. It relies on every slot holding
  finite values (checked when an adapter is read), so that masked-out slots, including one
  an upload is rewriting, add exact zeros. 15 small kernels a layer: on the H200
  (`python -m benchmarks lora`, Llama-3-8B, B=64 decode at context 2048, rank 16 on all seven
  projections, 16 slots, CUDA graphs) 12.3 ms a step against 9.9 ms for the base model
  (1.245x) at 1, 4 and 16 adapters alike: bound by kernel count, not by the slots.
- segment (`graph_step`, kernel "flashinfer"): flashinfer's segment GEMM
  (`SegmentGEMMWrapper`), one segment per token with its slot as the weight index (base
  tokens read the zero row), a shrink and an expand per part. fp16/bf16 on CUDA; an explicit
  choice only (48 ms, 4.9x the base step, in the same benchmark).

`LoraWeights` are allocated once, before CUDA graphs are captured, and never reallocated (the
graphs hold their addresses); the cache (engine/lora/lora_cache.py) fills and clears slots.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engine.config import LORA_KERNELS
from engine.lora.lora_adapter import FUSED_TARGETS, LoraAdapter, module_shape
from vocabulary.model_config import ModelConfig

OVERLAP_SHRINK = True
"""The "dot" kernel's shrink runs on a side stream beside the base projection (`LoraStep.begin`)
on CUDA; False: in line after it (benchmarks compare the two)."""
RANK_ALIGN = 16
"""Slots are padded to a multiple of this rank (the segment GEMM's alignment)."""
SELF_CHECK_TOLERANCE = 2e-2
"""Largest relative error a graph kernel may show against fp32 torch in `check_graph_kernel`
(bf16 rounding ~4e-3)."""
_SEGMENT_WORKSPACE_BYTES = 32 * 1024 * 1024

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProjectionParts:
    """How PEFT modules sit in one fused projection's output columns."""

    fan_in: int
    modules: tuple[str, ...]
    columns: tuple[tuple[int, int], ...]
    """[start, end) of each module's output in the fused output, in `modules` order."""


def projection_parts(cfg: ModelConfig) -> dict[str, ProjectionParts]:
    """Fused projection → its parts (engine/loading/hf_checkpoint.py's fusion order)."""
    out: dict[str, ProjectionParts] = {}
    for module, (proj, _) in FUSED_TARGETS.items():
        fan_in, fan_out = module_shape(cfg, module)
        prev = out.get(proj)
        start = prev.columns[-1][1] if prev else 0
        modules = (*prev.modules, module) if prev else (module,)
        columns = (*prev.columns, (start, start + fan_out)) if prev else ((start, fan_out),)
        out[proj] = ProjectionParts(fan_in, modules, columns)
    return out


def lora_kernel_unavailable_reason(
    kernel: str, device: torch.device, dtype: torch.dtype
) -> str | None:
    """Why a graph kernel cannot run here, or None when it can."""
    if kernel not in LORA_KERNELS:
        return f"lora kernel: one of {', '.join(LORA_KERNELS)}, got {kernel!r}"
    if kernel == "flashinfer":
        if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
            return f"flashinfer's segment GEMM runs fp16/bf16 on CUDA (got {dtype} on {device})"
        try:
            _segment_gemm_class()
        except Exception as e:  # an optional extra: any import failure means "not here"
            return f"flashinfer's SegmentGEMMWrapper does not import: {e}"
    if kernel == "triton":
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"the triton LoRA kernel runs fp16/bf16/fp32 (got {dtype})"
        try:
            import triton

            from engine.lora import lora_triton  # noqa: F401  (its kernels compile at first use)
        except Exception as e:  # an optional dependency: any import failure means "not here"
            return f"the triton LoRA kernel needs triton, which does not import: {e}"
        interpreted = device.type == "cpu" and triton.knobs.runtime.interpret
        if device.type != "cuda" and not interpreted:
            return f"the triton LoRA kernel runs on CUDA (or with TRITON_INTERPRET=1), not {device}"
    return None


def select_lora_kernel(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The graph kernel for a request; ValueError when an explicit request cannot run here.

    "auto": triton (its "dot" path, engine/lora/lora_dot.py) on CUDA in fp16/bf16 where it imports
    and passes `check_graph_kernel`, else torch. H200, `python -m benchmarks lora` (Llama-3-8B B=64
    decode at context 2048, rank 16 on all seven projections, CUDA graphs): dot (its shrink
    beside the base GEMM) 1.065x the base step with 4 slots and 1.120x with 16, the dense
    torch kernel 1.223x / 1.247x; the
    per-token (BGMV) triton expands 1.46x; flashinfer's segment GEMM 4.9x."""
    if requested == "auto":
        if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
            return "torch"
        reason = lora_kernel_unavailable_reason("triton", device, dtype)
        if reason is not None:
            log.info("%s: torch LoRA kernel", reason)
            return "torch"
        try:
            err = check_graph_kernel("triton", device, dtype)
        except Exception:
            log.warning("the triton LoRA kernel failed its self-check", exc_info=True)
            return "torch"
        if err > SELF_CHECK_TOLERANCE:
            log.warning("the triton LoRA kernel is off by %.2e: torch LoRA kernel", err)
            return "torch"
        return "triton"
    reason = lora_kernel_unavailable_reason(requested, device, dtype)
    if reason is not None:
        raise ValueError(reason)
    return requested


def check_graph_kernel(kernel: str, device: torch.device, dtype: torch.dtype) -> float:
    """The worst relative error of a graph kernel's LoRA delta against fp32 torch on a small
    model shape (one layer, every projection, three slots of rank 16 and base tokens, widths
    that are no multiple of the kernels' tiles)."""
    cfg = ModelConfig.from_dict(
        {
            "vocab_size": 16,
            "hidden_size": 320,
            "intermediate_size": 704,
            "num_hidden_layers": 1,
            "num_attention_heads": 5,
            "num_key_value_heads": 1,
        }
    )
    weights = LoraWeights(cfg, 3, RANK_ALIGN, dtype, device, kernel)
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)

    for proj, a in weights.a.items():
        a.copy_(randn(*a.shape, scale=a.shape[-1] ** -0.5))
        for b in weights.b[proj]:
            b.copy_(randn(*b.shape))
    slots = [2, 0, -1, 1, 1, 2, -1]
    step = graph_step(weights, torch.tensor(slots, dtype=torch.int32, device=device))
    worst = 0.0
    for proj, parts in weights.parts.items():
        x = randn(len(slots), parts.fan_in)
        got = torch.zeros((len(slots), parts.columns[-1][1]), dtype=dtype, device=device)
        step.add(0, proj, x, got)
        want = torch.zeros_like(got, dtype=torch.float32)
        for t, s in enumerate(slots):
            for p, (lo, hi) in enumerate(parts.columns):
                if s >= 0:
                    shrunk = weights.a[proj][0, p, s].float() @ x[t].float()
                    want[t, lo:hi] = shrunk @ weights.b[proj][p][0, s].float()
        err = (got.float() - want).norm() / want.norm().clamp_min(1e-30)
        worst = max(worst, float(err))
    return worst


def _segment_gemm_class() -> Any:
    gemm = importlib.import_module("flashinfer.gemm")
    return (
        getattr(gemm, "SegmentGEMMWrapper", None)
        or importlib.import_module("flashinfer").SegmentGEMMWrapper
    )


class LoraWeights:
    """Every device slot's A and B, per fused projection, stacked over layers.

    a[proj]: [layers, parts, rows, rank, in]; b[proj][part]: [layers, rows, rank, out], with
    rows = num_slots, plus one all-zero row (index num_slots) that base tokens of the segment
    kernel read. This layout keeps every kernel's operand a view: the dense kernel's
    [parts * rows * rank, in] and [rows * rank, out] matrices, the segment kernel's
    [rows, rank, in] stacks, the triton kernel's [parts, rows, rank, in] layer, a slot's
    [rank, in] matrix. A slot holds an adapter's rank r in
    ranks [0, r) and zeros elsewhere (a module it does not target is all zero);
    `slot_modules[s]` and `slot_ranks[s]` say what slot s holds.

    Size: layers x rows x rank x (sum of in + out over the seven modules) elements (Llama-3-8B,
    16 slots of rank 16 in bf16: 1.3 GiB). The dense kernel reads all of it every LoRA decode
    step, so max_loras and max_lora_rank should be what is served, not more.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        kernel: str = "torch",
        may_fall_back: bool = False,
    ) -> None:
        """`kernel`: the CUDA-graph kernel ("torch", "flashinfer" or "triton"); `may_fall_back`:
        it was chosen, not requested, so the runner may switch it to torch (`use_torch_kernel`)
        if capturing graphs with it fails."""
        self.cfg = cfg
        self.num_slots = num_slots
        self.rank = -(-max_rank // RANK_ALIGN) * RANK_ALIGN
        self.dtype = dtype
        self.device = device
        self.kernel = kernel
        self.may_fall_back = may_fall_back
        self.parts = projection_parts(cfg)
        layers, r = cfg.num_layers, self.rank
        rows = num_slots + (kernel == "flashinfer")
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, tuple[torch.Tensor, ...]] = {}
        for proj, parts in self.parts.items():
            shape = (layers, len(parts.modules), rows, r, parts.fan_in)
            self.a[proj] = torch.zeros(shape, dtype=dtype, device=device)
            self.b[proj] = tuple(
                torch.zeros((layers, rows, r, hi - lo), dtype=dtype, device=device)
                for lo, hi in parts.columns
            )
        self.slot_modules: list[frozenset[str]] = [frozenset()] * num_slots
        self.slot_ranks = [0] * num_slots
        self.segment_gemm: Any = None
        self._side_stream: torch.cuda.Stream | None = None
        if kernel == "flashinfer":
            workspace = torch.empty(_SEGMENT_WORKSPACE_BYTES, dtype=torch.int8, device=device)
            self.segment_gemm = _segment_gemm_class()(workspace)

    def use_torch_kernel(self) -> None:
        """Graph steps made from now on use the dense torch kernel, whatever kernel the slots
        were made for (the segment kernel's zero row, if any, is a slot no token matches)."""
        self.kernel, self.segment_gemm, self.may_fall_back = "torch", None, False

    def side_stream(self) -> torch.cuda.Stream:
        """The stream LoRA shrinks overlap the base projections on (made at first use; CUDA)."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        return self._side_stream

    @property
    def nbytes(self) -> int:
        tensors = [*self.a.values(), *(t for parts in self.b.values() for t in parts)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def fill(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy an adapter into `slot` on the current stream (non-blocking from pinned host
        memory; the caller orders it after the steps that read the slot's last occupant)."""
        self.clear(slot)
        r = adapter.spec.rank
        for module in adapter.spec.modules:
            proj, part = FUSED_TARGETS[module]
            self.a[proj][:, part, slot, :r].copy_(adapter.a[module], non_blocking=True)
            self.b[proj][part][:, slot, :r].copy_(adapter.b[module], non_blocking=True)
        self.slot_modules[slot] = frozenset(adapter.spec.modules)
        self.slot_ranks[slot] = r

    def clear(self, slot: int) -> None:
        """Zero `slot` (on the current stream)."""
        for proj, a in self.a.items():
            a[:, :, slot].zero_()
            for b in self.b[proj]:
                b[:, slot].zero_()
        self.slot_modules[slot] = frozenset()
        self.slot_ranks[slot] = 0


@dataclass(frozen=True)
class SlotRows:
    """The tokens of one step that read one slot: rows [start, end), or `index` (device
    int64) when they are not one run."""

    slot: int
    start: int
    end: int
    index: torch.Tensor | None = None


class LoraStep:
    """One step's LoRA: which slot each token reads, and the kernel that adds the deltas.
    Made by `eager_step` or `graph_step`; valid for one forward pass."""

    def __init__(
        self,
        weights: LoraWeights,
        projections: frozenset[str],
        groups: tuple[SlotRows, ...] | None = None,
        token_slots: torch.Tensor | None = None,
        kernel: str = "torch",
    ) -> None:
        self.weights = weights
        self.projections = projections
        """The fused projections some token of the step adapts (the rest run as the base)."""
        self._groups = groups
        self._kernel = kernel
        self._onehot: torch.Tensor | None = None
        self._indices: torch.Tensor | None = None
        self._indptr: torch.Tensor | None = None
        self._slots: torch.Tensor | None = None
        self._side: torch.cuda.Stream | None = None
        if groups is None:
            assert token_slots is not None
            self._prepare_graph(token_slots)

    def _prepare_graph(self, slots: torch.Tensor) -> None:
        """Per-step tensors of the graph kernels, made once before the first layer."""
        n = self.weights.num_slots
        if self._kernel == "triton":  # reads the graph's slots as they are (int32)
            ok = slots.dtype in (torch.int32, torch.int64) and slots.is_contiguous()
            self._slots = slots if ok else slots.int().contiguous()
            from engine.lora import lora_triton

            dot = lora_triton.DEFAULT_SHRINK == "dot"
            if dot and OVERLAP_SHRINK and slots.device.type == "cuda":
                self._side = self.weights.side_stream()
            return
        slots = slots.long()
        if self._kernel == "flashinfer":  # base tokens read the zero row
            self._indices = torch.where(slots < 0, torch.full_like(slots, n), slots)
            self._indptr = torch.arange(slots.shape[0] + 1, dtype=torch.int64, device=slots.device)
        else:  # one column per row of the weights; base tokens match none
            ids = torch.arange(self.weights.a["o_proj"].shape[2], device=slots.device)
            self._onehot = (slots[:, None] == ids[None, :]).to(self.weights.dtype)

    def begin(self, layer: int, proj: str, x: torch.Tensor) -> torch.Tensor | None:
        """Before the base projection `proj` of x: with the "dot" kernel on CUDA, start its
        shrink on the side stream (it reads only x and the slots' A, so it runs beside the
        base GEMM, which leaves SMs idle at decode batch sizes, instead of after it: in a CUDA
        graph the two become parallel branches) and return its output for `add`; else None
        (`add` does all the work)."""
        if self._side is None or proj not in self.projections:
            return None
        from engine.lora.lora_dot import shrink_dot

        a = self.weights.a[proj][layer]
        h = torch.empty((x.shape[0], a[..., 0].numel()), dtype=x.dtype, device=x.device)
        # h is allocated on the main stream, which waits for the side stream in `add` before
        # it reads h or frees it: no cross-stream reuse of its memory
        self._side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(self._side):
            shrink_dot(x, a, h)
        return h

    def add(
        self,
        layer: int,
        proj: str,
        x: torch.Tensor,
        out: torch.Tensor,
        begun: torch.Tensor | None = None,
    ) -> None:
        """out += the LoRA delta of projection `proj` of `layer` for input x (in place);
        `begun`: what `begin` returned for this projection."""
        if proj not in self.projections:
            return
        if self._groups is not None:
            self._add_grouped(layer, proj, x, out)
        elif self._slots is not None:
            self._add_triton(layer, proj, x, out, begun)
        elif self._onehot is not None:
            self._add_dense(layer, proj, x, out)
        else:
            self._add_segment(layer, proj, x, out)

    def _add_grouped(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> None:
        w = self.weights
        parts = w.parts[proj]
        assert self._groups is not None
        for g in self._groups:
            r, targeted = w.slot_ranks[g.slot], w.slot_modules[g.slot]
            xs = x[g.start : g.end] if g.index is None else x.index_select(0, g.index)
            for p, module in enumerate(parts.modules):
                if module not in targeted:
                    continue
                shrunk = F.linear(xs, w.a[proj][layer, p, g.slot, :r])
                b = w.b[proj][p][layer, g.slot, :r]
                lo, hi = parts.columns[p]
                if g.index is None:
                    out[g.start : g.end, lo:hi].addmm_(shrunk, b)
                else:
                    out[:, lo:hi].index_add_(0, g.index, shrunk @ b)

    def _add_dense(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> None:
        # shrink against every row of every part at once, zero what is not the token's slot,
        # then one matmul per part straight into its columns of out
        a = self.weights.a[proj][layer]  # [parts, rows, rank, in]
        num_parts, rows, r, fan_in = a.shape
        t = x.shape[0]
        assert self._onehot is not None
        shrunk = F.linear(x, a.reshape(-1, fan_in)).view(t, num_parts, rows, r)
        shrunk.mul_(self._onehot[:, None, :, None])
        shrunk = shrunk.view(t, num_parts, rows * r)
        for p, (lo, hi) in enumerate(self.weights.parts[proj].columns):
            b = self.weights.b[proj][p][layer].reshape(rows * r, hi - lo)
            out[:, lo:hi].addmm_(shrunk[:, p], b)

    def _add_triton(
        self,
        layer: int,
        proj: str,
        x: torch.Tensor,
        out: torch.Tensor,
        begun: torch.Tensor | None,
    ) -> None:
        from engine.lora.lora_triton import add_lora

        w = self.weights
        assert self._slots is not None
        b = [part[layer] for part in w.b[proj]]
        a = w.a[proj][layer]
        if begun is None:
            add_lora(x, out, self._slots, a, b, w.parts[proj].columns)
            return
        from engine.lora.lora_dot import expand_dot

        assert self._side is not None
        torch.cuda.current_stream(x.device).wait_stream(self._side)
        expand_dot(begun, out, self._slots, a.shape, b, w.parts[proj].columns)

    def _add_segment(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> None:
        w = self.weights
        run, t, x = w.segment_gemm.run, x.shape[0], x.contiguous()
        common = {"seg_indptr": self._indptr, "weight_indices": self._indices}
        for p, (lo, hi) in enumerate(w.parts[proj].columns):
            shrunk = run(x, w.a[proj][layer, p], t, True, **common)  # [t, rank]
            out[:, lo:hi].add_(run(shrunk, w.b[proj][p][layer], t, False, **common))


def _projections_of(weights: LoraWeights, slots: set[int]) -> frozenset[str]:
    return frozenset(FUSED_TARGETS[m][0] for s in slots for m in weights.slot_modules[s])


def eager_step(
    weights: LoraWeights, token_slots: np.ndarray, device: torch.device
) -> LoraStep | None:
    """The grouped LoraStep of a step whose token t reads slot token_slots[t] (-1: base), or
    None when no token reads an adapter (the step runs as the base model). Index tensors of
    slots whose tokens are not one run are copied to the device here (non-blocking)."""
    from engine.device import to_device

    used = sorted({int(s) for s in np.unique(token_slots) if s >= 0})
    if not used:
        return None
    groups: list[SlotRows] = []
    for slot in used:
        rows = np.flatnonzero(token_slots == slot)
        start, end = int(rows[0]), int(rows[-1]) + 1
        index = (
            None if end - start == rows.shape[0] else to_device(rows.tolist(), torch.long, device)
        )
        groups.append(SlotRows(slot, start, end, index))
    return LoraStep(weights, _projections_of(weights, set(used)), groups=tuple(groups))


def graph_step(weights: LoraWeights, token_slots: torch.Tensor) -> LoraStep:
    """The LoraStep of a CUDA-graph body: token t reads slot token_slots[t] (a device tensor
    of the graph's inputs; -1: base); shapes fixed, every projection adapted."""
    return LoraStep(
        weights, frozenset(weights.parts), token_slots=token_slots, kernel=weights.kernel
    )
