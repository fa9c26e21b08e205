"""flashinfer paged decode attention on one GPU, kernel by kernel, against its KV-read floor.

The engine's decode attention (engine/attention/flashinfer_backend.py) plans
`BatchDecodeWithPagedKVCacheWrapper` with tensor cores (flashinfer then runs its prefill
kernel on one query row per sequence). This times that kernel and the CUDA-core decode kernel
(`use_tensor_cores=False`) side by side in one run, for bf16 and e4m3 KV and the Llama-3-8B
(32 query / 8 KV heads) and Llama-3-70B (64 / 8) head layouts, over the strided per-layer view
of a block-major pool as the engine lays it out ([blocks, layers, 2, page, kv_heads, 128]),
each layer's KV (256-512 MiB at B=64 x 2048) far larger than the 50 MB L2. The floor is the
KV bytes read over the HBM copy bandwidth measured in the same run.

    python benchmarks/bench_attention.py [--batch 64] [--context 2048] [--page 16]
"""

from __future__ import annotations

import argparse

import torch

LAYERS = 2
"""Layers in the pool: runs alternate between them, so no run reads what the last one did."""


def hbm_gbps() -> float:
    """Device copy bandwidth, read + write counted (GB/s)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3) / 1e9


def time_decode(
    qo_heads: int, kv_dtype: torch.dtype, tensor_cores: bool, args: argparse.Namespace
) -> float:
    """Seconds per decode attention call (one layer) at args.batch x args.context."""
    import flashinfer

    kv_heads, dim, page = 8, 128, args.page
    pages_per_seq = -(-args.context // page)
    blocks = args.batch * pages_per_seq
    pool = torch.empty(blocks, LAYERS, 2, page, kv_heads, dim, dtype=kv_dtype, device="cuda")
    for i in range(0, blocks, 1024):  # random KV, a slice at a time
        part = pool[i : i + 1024]
        part.copy_(torch.randn(part.shape, device="cuda").clamp(-4, 4))
    indptr = torch.arange(0, blocks + 1, pages_per_seq, dtype=torch.int32)
    indices = torch.randperm(blocks, dtype=torch.int32, device="cuda")
    last = torch.full((args.batch,), args.context - (pages_per_seq - 1) * page, dtype=torch.int32)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=tensor_cores, backend="fa2"
    )
    wrapper.plan(
        indptr, indices, last, qo_heads, kv_heads, dim, page,
        q_data_type=torch.bfloat16, kv_data_type=kv_dtype, sm_scale=dim**-0.5,
    )  # fmt: skip
    q = torch.randn(args.batch, qo_heads, dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    scales = {"k_scale": 0.05, "v_scale": 0.05} if kv_dtype != torch.bfloat16 else {}

    def run(layer: int) -> None:
        wrapper.run(q, pool[:, layer], out=out, **scales)

    for i in range(5):
        run(i % LAYERS)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(args.iters):
        run(i % LAYERS)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / args.iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()
    gbps = hbm_gbps()
    print(f"HBM copy {gbps:.0f} GB/s; B={args.batch} x {args.context} tokens, page {args.page}")
    print(f"{'heads q/kv':<11}{'KV':<7}{'kernel':<22}{'per layer':>11}{'floor':>9}{'ratio':>8}")
    for qo_heads in (32, 64):
        for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            kv_bytes = args.batch * args.context * 2 * 8 * 128 * kv_dtype.itemsize
            floor = kv_bytes / (gbps * 1e9)
            for tensor_cores in (True, False):
                try:
                    sec = time_decode(qo_heads, kv_dtype, tensor_cores, args)
                    torch.cuda.empty_cache()  # the pool of the last call
                except Exception as e:  # a kernel flashinfer does not build for this shape
                    print(f"{qo_heads}/8 {kv_dtype} tensor_cores={tensor_cores}: {e!r}"[:200])
                    continue
                name = "tensor cores (prefill)" if tensor_cores else "CUDA-core decode"
                dtype = "bf16" if kv_dtype == torch.bfloat16 else "e4m3"
                print(f"{qo_heads}/8{'':<7}{dtype:<7}{name:<22}{sec * 1e6:>8.1f} us"
                      f"{floor * 1e6:>6.1f} us{sec / floor:>7.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
