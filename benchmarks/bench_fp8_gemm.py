"""FP8 decode GEMMs of the Llama-3-70B shape on one GPU: which operand order cuBLASLt streams
the weights fastest in.

A decode projection is skinny: M = batch rows of activations against an [N, K] e4m3 weight.
The engine computes `x · Wᵀ` (`_scaled_mm(x, W.t())`, output [M, N]); the same product as
`W · xᵀ` (`_scaled_mm(W, x.t())`, output [N, M], the transpose) hands cuBLASLt the weight as
its M side, where its heuristics pick other tiles. This times both for each projection at
M = 1, 16, 64, in CUDA graphs over LAYERS distinct weights (so nothing is read from L2), and
prints the weight-read rate against the HBM copy rate measured in the same run.

    python benchmarks/bench_fp8_gemm.py [--batches 1,16,64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_timing import graph_seconds, hbm_gbps

from engine.quantization.fp8_linear import FP8_DTYPE

LAYERS = 8
SHAPES = {  # name: (N, K) of the Llama-3-70B projections
    "qkv": (10240, 8192),
    "o": (8192, 8192),
    "gate_up": (57344, 8192),
    "down": (8192, 28672),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,16,64")
    args = parser.parse_args()
    gbps = hbm_gbps()
    print(f"HBM copy {gbps:.0f} GB/s")
    one = torch.tensor(1.0, device="cuda")
    rows = []
    for name, (n, k) in SHAPES.items():
        weights = [
            torch.randn(n, k, device="cuda").clamp(-4, 4).to(FP8_DTYPE) for _ in range(LAYERS)
        ]
        for m in [int(b) for b in args.batches.split(",")]:
            x = torch.randn(m, k, device="cuda").clamp(-4, 4).to(FP8_DTYPE)
            pad = max(m, 16)  # cuBLASLt FP8 wants dims divisible by 16
            xp = torch.zeros(pad, k, device="cuda", dtype=FP8_DTYPE)
            xp[:m] = x

            def x_wt(x: torch.Tensor = x, weights: list[torch.Tensor] = weights) -> None:
                for w in weights:
                    torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

            def w_xt(xp: torch.Tensor = xp, weights: list[torch.Tensor] = weights) -> None:
                for w in weights:
                    torch._scaled_mm(w, xp.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

            floor_us = n * k / (gbps * 1e9) * 1e6
            got = {}
            for label, body in (("x·Wᵀ", x_wt), ("W·xᵀ", w_xt)):
                try:
                    got[label] = graph_seconds(body) * 1e6 / LAYERS
                except RuntimeError as e:  # a shape cuBLASLt refuses
                    print(f"{name} M={m} {label}: {e}"[:200])
            for label, us in got.items():
                rows.append((name, m, label, us, floor_us))
                print(f"{name:<8} M={m:<3} {label:<6} {us:8.1f} us  floor {floor_us:6.1f}"
                      f"  {us / floor_us:5.2f}x", flush=True)  # fmt: skip
    print("\n| projection | M | x·Wᵀ (engine) | W·xᵀ | floor |\n|---|---|---|---|---|")
    by = {(r[0], r[1], r[2]): r[3] for r in rows}
    for name, (n, k) in SHAPES.items():
        for m in [int(b) for b in args.batches.split(",")]:
            floor_us = n * k / (gbps * 1e9) * 1e6
            a, b = by.get((name, m, "x·Wᵀ")), by.get((name, m, "W·xᵀ"))
            cell = [f"{v:.1f} µs ({v / floor_us:.2f}x)" if v else "-" for v in (a, b)]
            print(f"| {name} | {m} | {cell[0]} | {cell[1]} | {floor_us:.1f} µs |")


if __name__ == "__main__":
    main()
