"""Does prefetching o_proj's weights into L2 while decode attention runs shorten the layer?

At B=64 x 2048 on the Llama-3-70B shape the Triton e4m3 decode attention reads its KV at ~64%
of HBM bandwidth (98 µs against a 63 µs read), and o_proj (64 MiB of e4m3 weights) follows
it. This times, in one CUDA graph over LAYERS distinct layers (distinct KV and distinct
weights, so nothing is in L2 from the call before), the pair attention → o_proj GEMM:

- serial: as the engine runs it today;
- prefetch P MiB: a side-stream kernel (a parallel branch in the graph) reads the first P MiB
  of the layer's o_proj weights with L2 evict-last hints while attention runs, then the GEMM
  runs. (The 2026-12-05 run also read the KV with evict-first hints: no difference, so that
  option of the decode kernel was removed.)

    python benchmarks/bench_l2_prefetch.py [--mib 0,16,24,32,40] [--programs 8,16,32]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_timing import graph_seconds

from engine.attention.triton_decode import PagedDecode
from engine.quantization.fp8_linear import FP8_DTYPE

LAYERS = 8
B, CTX, PAGE, HEADS, KV_HEADS, DIM, HIDDEN = 64, 2048, 16, 64, 8, 128, 8192


@triton.jit
def _touch(ptr, n_words, sink_ptr, BLOCK: tl.constexpr):
    """Read n_words int32 words from ptr with evict-last hints (program p reads every
    num_programs-th block); store their sum only if it is a value it never is."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(pid * BLOCK, n_words, step):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(ptr + offs, mask=offs < n_words, other=0, eviction_policy="evict_last")
    total = tl.sum(acc, 0)
    tl.store(sink_ptr + pid, total, mask=total == -123456789)


def graph_ms(body: Callable[[], object]) -> float:
    return graph_seconds(body) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", default="0,16,24,32,40")
    parser.add_argument("--programs", default="8,16,32")
    args = parser.parse_args()
    pages = CTX // PAGE
    blocks = B * pages
    pools = [
        torch.randn(blocks, 2, PAGE, KV_HEADS, DIM, device="cuda").clamp(-4, 4).to(FP8_DTYPE)
        for _ in range(LAYERS)
    ]
    weights = [
        torch.randn(HIDDEN, HEADS * DIM, device="cuda").clamp(-4, 4).to(FP8_DTYPE)
        for _ in range(LAYERS)
    ]
    indices = torch.randperm(blocks, dtype=torch.int32, device="cuda")
    indptr = torch.arange(0, blocks + 1, pages, dtype=torch.int32, device="cuda")
    last = torch.full((B,), PAGE, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    one = torch.tensor(1.0, device="cuda")
    sink = torch.zeros(1024, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    results: list[tuple[str, float]] = []
    kernel = PagedDecode(B, HEADS, KV_HEADS, DIM, PAGE, q.device, 1)
    out = torch.empty(B, HEADS, DIM, dtype=FP8_DTYPE, device="cuda")

    def attend(i: int) -> None:
        kernel.run(q, pools[i], indices, indptr, last, DIM**-0.5, 0.05, 0.05, out, one)

    def gemm(i: int) -> torch.Tensor:
        x = out.view(B, HEADS * DIM)
        bf16 = torch.bfloat16
        return torch._scaled_mm(x, weights[i].t(), scale_a=one, scale_b=one, out_dtype=bf16)

    def attend_only() -> None:
        for i in range(LAYERS):
            attend(i)

    def gemm_only() -> None:
        for i in range(LAYERS):
            gemm(i)

    results.append(("attention alone", graph_ms(attend_only) / LAYERS))
    results.append(("o_proj GEMM alone", graph_ms(gemm_only) / LAYERS))
    for mib in [int(x) for x in args.mib.split(",")]:
        for programs in [int(x) for x in args.programs.split(",")] if mib else [0]:
            words = mib * (1 << 20) // 4

            def body(words: int = words, programs: int = programs) -> None:
                main_stream = torch.cuda.current_stream()
                for i in range(LAYERS):
                    if words:
                        side.wait_stream(main_stream)
                        with torch.cuda.stream(side):
                            _touch[(programs,)](
                                weights[i].view(torch.int32), words, sink, BLOCK=4096
                            )
                    attend(i)
                    if words:
                        main_stream.wait_stream(side)
                    gemm(i)

            ms = graph_ms(body) / LAYERS
            name = f"attn -> o_proj, prefetch {mib} MiB x{programs}"
            results.append((name, ms))
            print(f"{name:<60}{ms * 1e3:8.1f} us", flush=True)
    print("\n| what | µs per layer |\n|---|---|")
    for name, ms in results:
        print(f"| {name} | {ms * 1e3:.1f} |")


if __name__ == "__main__":
    main()
