"""Paged decode attention on one GPU, kernel by kernel, against its KV-read floor.

The engine's decode attention plans flashinfer's `BatchDecodeWithPagedKVCacheWrapper` with
tensor cores (flashinfer then runs its prefill kernel on one query row per sequence), or runs
the Triton split-KV kernel of engine/attention/triton_decode.py. This times, side by side in
one run, for bf16 and e4m3 KV and the Llama-3-8B (32 query / 8 KV heads) and Llama-3-70B
(64 / 8) head layouts, over the strided per-layer view of a block-major pool as the engine lays
it out ([blocks, layers, 2, page, kv_heads, 128], pages in random order), each layer's KV
(256-512 MiB at B=64 x 2048) far larger than the 50 MB L2:
- flashinfer, tensor cores (the engine's flashinfer choice) and its CUDA-core decode kernel;
- flashinfer's XQA decode, where this flashinfer has it;
- the Triton kernel over a sweep of tiles and split counts (best per shape, and the table);
- every output checked against a float32 reference (worst absolute error).
Times are CUDA-graph replays of 16 calls that alternate between layers. The floor is the KV
bytes read over the HBM copy bandwidth measured in the same run.

`--layouts` adds the head-major pool ([blocks, kv_heads, layers, 2, page, 128], the layout
cross-TP hand-offs slice by head): flashinfer's decode and prefill on its permuted per-layer
view, compared bit for bit with the block-major view holding the same KV.

    python -m benchmarks attention [--batch 64] [--context 2048] [--page 16] [--layouts]
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable, Sequence

import torch

from benchmarks.harness.cuda_timing import fill_random, graph_seconds, hbm_gbps
from engine.attention.triton_decode import (
    DecodeTiles,
    NewKV,
    PagedDecode,
    Rope,
    max_abs_error,
    reference_decode,
)

KV_HEADS, DIM = 8, 128
CALLS = 16
"""Calls per timed CUDA-graph replay."""


class Case:
    """One batch of sequences over a random pool: the page arrays flashinfer and the Triton
    kernel take, and the dense page table XQA takes."""

    def __init__(
        self, args: argparse.Namespace, qo_heads: int, kv_dtype: torch.dtype,
        layers: int = 2, layer_major: bool = False,
    ) -> None:  # fmt: skip
        page = args.page
        self.qo_heads, self.kv_dtype, self.page = qo_heads, kv_dtype, page
        self.layers, self.layer_major = layers, layer_major
        """Layers in the pool: calls go round them, so no call reads what the last one did;
        with the model's layer count, one layer's pages lie as far apart as in the engine,
        unless `layer_major` ([layers, blocks, 2, page, kv_heads, D]) keeps each together."""
        pages_per_seq = -(-args.context // page)
        self.blocks = args.batch * pages_per_seq
        block = (2, page, KV_HEADS, DIM)
        shape = (layers, self.blocks, *block) if layer_major else (self.blocks, layers, *block)
        self.pool = torch.empty(shape, dtype=kv_dtype, device="cuda")
        fill_random(self.pool, 4)
        self.indptr = torch.arange(0, self.blocks + 1, pages_per_seq, dtype=torch.int32)
        self.indices = torch.randperm(self.blocks, dtype=torch.int32, device="cuda")
        last = args.context - (pages_per_seq - 1) * page
        self.last = torch.full((args.batch,), last, dtype=torch.int32)
        self.seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32, device="cuda")
        self.table = self.indices.view(args.batch, pages_per_seq)
        self.q = torch.randn(args.batch, qo_heads, DIM, dtype=torch.bfloat16, device="cuda")
        fp8 = kv_dtype == torch.float8_e4m3fn
        self.k_scale, self.v_scale = (0.05, 0.05) if fp8 else (1.0, 1.0)
        self.floor_bytes = args.batch * args.context * 2 * KV_HEADS * DIM * kv_dtype.itemsize
        self.dev_indptr, self.dev_last = self.indptr.cuda(), self.last.cuda()

        self.head_major: torch.Tensor | None = None

    def use_head_major(self) -> None:
        """Keep the same KV in the head-major layout ([blocks, kv_heads, layers, 2, page, D]);
        `layer` then returns its permuted per-layer view."""
        self.head_major = self.pool.permute(0, 4, 1, 2, 3, 5).contiguous()
        self.pool = self.pool[:0]
        torch.cuda.empty_cache()

    def layer(self, i: int) -> torch.Tensor:
        if self.head_major is not None:
            return self.head_major[:, :, i].permute(0, 2, 3, 1, 4)
        return self.pool[i] if self.layer_major else self.pool[:, i]

    def reference(self, layer: int) -> torch.Tensor:
        return reference_decode(
            self.q, self.layer(layer), self.indices, self.indptr, self.last, DIM**-0.5,
            self.k_scale, self.v_scale,
        )  # fmt: skip


def graph_time(call: Callable[[int], object], iters: int, layers: int = 2) -> float:
    """Seconds per call, from CUDA-graph replays of CALLS calls going round the layers."""
    for i in range(3):
        call(i % layers)

    def body() -> None:
        for i in range(CALLS):
            call(i % layers)

    return graph_seconds(body, iters) / CALLS


def flashinfer_decode(case: Case, tensor_cores: bool, view: Callable[[int], torch.Tensor]):
    import flashinfer

    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    b = case.q.shape[0]
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=case.dev_indptr, paged_kv_indices_buffer=case.indices,
        paged_kv_last_page_len_buffer=case.dev_last, backend="fa2",
    )  # fmt: skip
    wrapper.plan(
        case.indptr, case.indices, case.last, case.qo_heads, KV_HEADS, DIM, case.page,
        q_data_type=torch.bfloat16, kv_data_type=case.kv_dtype, sm_scale=DIM**-0.5,
    )  # fmt: skip
    out = torch.empty(b, case.qo_heads, DIM, dtype=torch.bfloat16, device="cuda")
    scales = {"k_scale": case.k_scale, "v_scale": case.v_scale} if case.k_scale != 1 else {}

    def call(layer: int) -> torch.Tensor:
        return wrapper.run(case.q, view(layer), out=out, **scales)

    return call, out


def xqa_decode(case: Case):
    from flashinfer.decode import xqa_batch_decode_with_kv_cache

    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(case.q)
    max_len = int(case.seq_lens.max())

    def call(layer: int) -> torch.Tensor:
        return xqa_batch_decode_with_kv_cache(
            case.q, case.layer(layer), workspace, case.table, case.seq_lens, max_len,
            bmm1_scale=DIM**-0.5 * case.k_scale, bmm2_scale=case.v_scale, out=out,
            kv_layout="NHD",
        )  # fmt: skip

    return call, out


def graph_step_inputs(case: Case) -> tuple[list[NewKV], Rope]:
    """What the CUDA-graph decode hands the launch besides q (NewKV and Rope): each
    sequence's last token's k/v as the pool holds it, dequantized to bf16 (so storing them
    again changes the pool by rounding at most), at positions rotated by an identity table
    (cos 1, sin 0), so the reference of the plain launch still holds."""
    b = case.q.shape[0]
    blocks = case.table[:, -1].contiguous()
    offsets = (case.dev_last - 1).int()
    rows = torch.arange(b, dtype=torch.int32, device="cuda")
    new = []
    for layer in range(case.layers):
        last = case.layer(layer)[blocks.long(), :, offsets.long()].float()  # [b, 2, heads, D]
        k = (last[:, 0] * case.k_scale).bfloat16().contiguous()
        v = (last[:, 1] * case.v_scale).bfloat16().contiguous()
        new.append(NewKV(k, v, rows, blocks, offsets))
    positions = (case.seq_lens - 1).int()
    identity = torch.cat((torch.ones(1, DIM // 2), torch.zeros(1, DIM // 2)), -1)
    cos_sin = identity.expand(int(case.seq_lens.max()), DIM).contiguous().cuda()
    return new, Rope(cos_sin, positions)


def triton_decode(case: Case, splits: int, tiles: DecodeTiles, fp8_out: int = 0, fused: int = 0):
    """The Triton kernel's launch; `fp8_out`: it writes e4m3 (o_proj's input) with scale 1/64,
    checked against the reference through that scale (the returned `out` is dequantized);
    `fused`: as the CUDA-graph decode runs it, storing the step's k/v and rotating q and k
    (`graph_step_inputs`)."""
    b = case.q.shape[0]
    kernel = PagedDecode(b, case.qo_heads, KV_HEADS, DIM, case.page, case.q.device, splits, tiles)
    scale = torch.tensor(2.0**-6, device="cuda") if fp8_out else None
    out = torch.empty_like(case.q, dtype=torch.float8_e4m3fn if fp8_out else case.q.dtype)
    new: list[NewKV | None] = [None] * case.layers
    rope: Rope | None = None
    if fused:
        steps, rope = graph_step_inputs(case)
        new = list(steps)

    def call(layer: int) -> torch.Tensor:
        return kernel.run(
            case.q, case.layer(layer), case.indices, case.dev_indptr, case.dev_last,
            DIM**-0.5, case.k_scale, case.v_scale, out=out, out_scale=scale,
            new_kv=new[layer], rope=rope,
        )  # fmt: skip

    class Dequantized:  # what `measure` compares with the reference, read after the call
        def float(self) -> torch.Tensor:
            return out.float() * (float(scale) if scale is not None else 1.0)

        def numel(self) -> int:
            return out.numel()

    return call, (Dequantized() if fp8_out else out), kernel


def report(name: str, case: Case, sec: float, err: float, gbps: float) -> None:
    floor = case.floor_bytes / (gbps * 1e9)
    dtype = "bf16" if case.kv_dtype == torch.bfloat16 else "e4m3"
    print(
        f"{case.qo_heads}/{KV_HEADS:<6}{dtype:<6}{name:<34}{sec * 1e6:>8.1f} us"
        f"{floor * 1e6:>7.1f} us{sec / floor:>7.2f}x   err {err:.2e}",
        flush=True,
    )


def measure(name: str, case: Case, make: Callable[[], tuple], ref: torch.Tensor, args, gbps):
    try:
        call, out = make()
        call(0)
        torch.cuda.synchronize()
        err = max_abs_error(out, ref)
        sec = graph_time(call, args.iters, case.layers)
    except Exception as e:  # a kernel this build lacks, or one that refuses the shape
        print(f"{case.qo_heads}/{KV_HEADS} {case.kv_dtype} {name}: {e!r}"[:300], flush=True)
        return None
    report(name, case, sec, err, gbps)
    return sec


def sweep_triton(case: Case, ref: torch.Tensor, args, gbps, layout: str = "block") -> None:
    best: tuple[float, str] | None = None
    for block_n, warps, stages, splits, kv_first, prefetch, hf, fp8_out, fused, e4m3 in (
        itertools.product(
            args.block_n, args.warps, args.stages, args.splits, args.kv_first, args.prefetch,
            args.heads_first, args.fp8_out, args.fused, args.scores_fp8,
        )
    ):  # fmt: skip
        if e4m3 and case.kv_dtype != torch.float8_e4m3fn:
            continue
        tiles = DecodeTiles(
            block_n, warps, stages, bool(kv_first), bool(prefetch), bool(hf), bool(e4m3)
        )
        name = (
            f"triton {layout} n{block_n} w{warps} s{stages} split{splits}"
            f"{' kv1' if kv_first else ''}{' pf' if prefetch else ''}"
            f"{' hf' if hf else ''}{' o8' if fp8_out else ''}{' fused' if fused else ''}"
            f"{' e4m3-scores' if e4m3 else ''}"
        )
        holder: dict[str, PagedDecode] = {}

        def make(
            t: DecodeTiles = tiles, s: int = splits, h: dict = holder, o8: int = fp8_out,
            f: int = fused,
        ) -> tuple:  # fmt: skip
            call, out, kernel = triton_decode(case, s, t, o8, f)
            h["kernel"] = kernel
            return call, out

        sec = measure(name, case, make, ref, args, gbps)
        launch = getattr(holder.get("kernel"), "last_launch", None)
        if launch is not None:
            regs, shared = getattr(launch, "n_regs", "?"), getattr(launch.metadata, "shared", "?")
            print(f"    registers {regs}, shared memory {shared} B", flush=True)
        if sec is not None and (best is None or sec < best[0]):
            best = (sec, name)
    if best is not None:
        report(f"BEST {best[1]}", case, best[0], 0.0, gbps)


def head_major_check(args: argparse.Namespace) -> None:
    """flashinfer on the head-major pool's permuted per-layer view vs the block-major view
    of the same KV: decode (tensor cores) and prefill (fa2), bit for bit, and decode time."""
    import flashinfer

    gbps = hbm_gbps()
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        case = Case(args, 32, kv_dtype)
        # [blocks, layers, 2, page, H, D] -> [blocks, H, layers, 2, page, D]
        head_major = case.pool.permute(0, 4, 1, 2, 3, 5).contiguous()
        del case.pool
        torch.cuda.empty_cache()
        block_major = head_major.permute(0, 2, 3, 4, 1, 5)  # the same values, block-major view

        def hm_view(layer: int, hm: torch.Tensor = head_major) -> torch.Tensor:
            return hm[:, :, layer].permute(0, 2, 3, 1, 4)  # [blocks, 2, page, H, D]

        bm_pool = block_major.contiguous()

        def bm_view(layer: int, bm: torch.Tensor = bm_pool) -> torch.Tensor:
            return bm[:, layer]

        outs = {}
        for label, view in (("block-major", bm_view), ("head-major", hm_view)):
            call, out = flashinfer_decode(case, True, view)
            call(0)
            torch.cuda.synchronize()
            outs[label] = out.clone()
            sec = graph_time(call, args.iters)
            report(f"flashinfer tc decode, {label}", case, sec, 0.0, gbps)
        same = torch.equal(outs["block-major"], outs["head-major"])
        print(f"decode head-major == block-major bit for bit: {same}", flush=True)
        # prefill: 4 sequences of 128 new tokens at the end of their pages
        workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        pre = {}
        for label, view in (("block-major", bm_view), ("head-major", hm_view)):
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
            n, new = 4, 128
            qo = torch.arange(0, n * new + 1, new, dtype=torch.int32)
            w.plan(
                qo, case.indptr[: n + 1], case.indices[: int(case.indptr[n])], case.last[:n],
                32, KV_HEADS, DIM, case.page, causal=True, q_data_type=torch.bfloat16,
                kv_data_type=kv_dtype, sm_scale=DIM**-0.5,
            )  # fmt: skip
            q = torch.randn(n * new, 32, DIM, dtype=torch.bfloat16, device="cuda",
                            generator=torch.Generator("cuda").manual_seed(1))  # fmt: skip
            scales = {"k_scale": 0.05, "v_scale": 0.05} if kv_dtype != torch.bfloat16 else {}
            pre[label] = w.run(q, view(1), **scales)
        same = torch.equal(pre["block-major"], pre["head-major"])
        print(f"prefill head-major == block-major bit for bit: {same}", flush=True)
        del head_major, bm_pool, block_major
        torch.cuda.empty_cache()


def run_case(case: Case, kernels: set[str], args: argparse.Namespace, gbps: float) -> None:
    """Every kernel of `kernels` on one case, checked against the float32 reference."""
    ref = case.reference(0)
    if "fi-tc" in kernels:
        make = functools.partial(flashinfer_decode, case, True, case.layer)
        measure("flashinfer tensor cores", case, make, ref, args, gbps)
    if "fi-cc" in kernels:
        make = functools.partial(flashinfer_decode, case, False, case.layer)
        measure("flashinfer CUDA-core decode", case, make, ref, args, gbps)
    if "xqa" in kernels:
        measure("flashinfer xqa", case, functools.partial(xqa_decode, case), ref, args, gbps)
    if "triton" in kernels:
        sweep_triton(case, ref, args, gbps)
    if "triton-head" in kernels:
        case.use_head_major()
        sweep_triton(case, ref, args, gbps, "head")


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--heads", type=ints, default=[32, 64], help="query heads (8 KV heads)")
    parser.add_argument("--kernels", default="fi-tc,fi-cc,xqa,triton")
    parser.add_argument("--block-n", type=ints, default=[32, 64, 128])
    parser.add_argument("--warps", type=ints, default=[4, 8])
    parser.add_argument("--stages", type=ints, default=[2, 3])
    parser.add_argument("--splits", type=ints, default=[1, 2, 4])
    parser.add_argument("--kv-first", type=ints, default=[0], help="0,1: V loaded with K")
    parser.add_argument("--prefetch", type=ints, default=[0], help="0,1: page ids a step ahead")
    parser.add_argument("--heads-first", type=ints, default=[1], help="0,1: grid KV heads first")
    parser.add_argument("--fp8-out", type=ints, default=[0], help="0,1: e4m3 output (o_proj's)")
    parser.add_argument(
        "--fused", type=ints, default=[0],
        help="0,1: also store the step's k/v and rotate q/k in the launch (the graph decode)",
    )  # fmt: skip
    parser.add_argument(
        "--scores-fp8", type=ints, default=[0],
        help="0,1: q rounded to e4m3, scores as K q^T over e4m3 (DecodeTiles.scores_fp8)",
    )  # fmt: skip
    parser.add_argument(
        "--pool-layers", type=ints, default=[2],
        help="layers in the block-major pool (80: a 70B pool's spacing of one layer's pages)",
    )  # fmt: skip
    parser.add_argument(
        "--layer-major", type=ints, default=[0],
        help="0,1: the pool as [layers, blocks, ...], each layer's pages together",
    )  # fmt: skip
    parser.add_argument("--layouts", action="store_true", help="the head-major layout check")
    parser.add_argument("--dtypes", default="bf16,e4m3")
    args = parser.parse_args(argv)
    kernels = set(args.kernels.split(","))
    gbps = hbm_gbps()
    print(f"HBM copy {gbps:.0f} GB/s; B={args.batch} x {args.context} tokens, page {args.page}")
    dtypes = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
    for qo_heads, dname, layers, layer_major in itertools.product(
        args.heads, args.dtypes.split(","), args.pool_layers, args.layer_major
    ):
        print(f"pool of {layers} layers, {'layer' if layer_major else 'block'}-major", flush=True)
        case = Case(args, qo_heads, dtypes[dname], layers, bool(layer_major))
        run_case(case, kernels, args, gbps)
        del case
        torch.cuda.empty_cache()
    if args.layouts:
        head_major_check(args)
