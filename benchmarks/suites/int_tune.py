"""`python -m benchmarks int --tune`: a few tilings of the Triton INT8 and INT4 GEMMs
(engine/quantization/int8_gemm.py, int4_gemm.py) per M bucket on the Llama-3-8B projection
shapes, each timed as a CUDA graph over distinct weight copies (more bytes than L2 holds, so
decode reads HBM as serving does) beside the paths they would replace, the fastest per bucket
printed and installed for the rest of the run (the model's layers are built after it).
A tiling whose numbers are not the torch ops' (INT8, bit for bit) or not within bf16 GEMM
precision and independent of the batch (INT4) is reported and never picked."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.harness.cuda_timing import graph_seconds
from engine.quantization import int4_gemm, int8_gemm
from engine.quantization.int4_linear import Int4Linear, pack_int4
from engine.quantization.int8_linear import _MIN_SCALE, HALF_RANGE, Int8Linear

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
"""Llama-3-8B's projections [out, in]: qkv, o, gate_up, down."""
L2_DEFEAT_BYTES = 160 * 2**20

C8 = int8_gemm.GemmConfig
INT8_CANDIDATES: dict[int, tuple[tuple[int, ...], list[int8_gemm.GemmConfig]]] = {
    16: ((1, 16), [
        C8(16, 64, 256, 0, 1, 4, 4, True), C8(16, 64, 256, 0, 1, 4, 4, False),
        C8(16, 32, 256, 0, 1, 4, 4, True), C8(16, 128, 128, 0, 1, 4, 4, True),
        C8(16, 64, 512, 0, 1, 4, 3, True), C8(16, 64, 256, 1, 1, 4, 4, True),
        C8(16, 128, 256, 0, 1, 8, 3, True), C8(16, 64, 128, 0, 1, 4, 6, True),
        C8(16, 64, 256, 0, 1, 4, 4, True, True), C8(16, 128, 256, 0, 1, 4, 4, True, True),
    ]),
    64: ((32, 64), [
        C8(64, 64, 128, 0, 1, 4, 4, False), C8(32, 64, 256, 0, 1, 4, 4, False),
        C8(64, 128, 128, 0, 1, 4, 4, False), C8(64, 64, 256, 0, 1, 4, 3, False),
        C8(32, 64, 128, 0, 1, 4, 4, True), C8(32, 64, 256, 0, 1, 4, 4, False, True),
    ]),
    256: ((256,), [
        C8(64, 128, 128, 1, 8, 4, 4, False), C8(128, 128, 128, 1, 8, 8, 3, False),
        C8(64, 256, 128, 1, 8, 8, 3, False), C8(128, 64, 128, 1, 8, 4, 4, False),
    ]),
    1 << 62: ((4096,), [
        C8(128, 256, 128, 1, 8, 8, 3, False), C8(128, 128, 128, 1, 8, 8, 4, False),
        C8(128, 256, 64, 1, 8, 8, 4, False), C8(256, 128, 128, 1, 8, 8, 3, False),
        C8(128, 128, 64, 1, 8, 4, 4, False),
    ]),
}  # fmt: skip
"""{bucket (int8_gemm.CONFIGS' key): (the rows timed, the tilings tried)}."""

C4 = int4_gemm.GemmConfig
INT4_ROWS = (1, 16)
INT4_CANDIDATES = [
    C4(32, 64, 1, 0, 4, 4), C4(32, 32, 1, 0, 4, 4), C4(32, 128, 1, 0, 4, 4),
    C4(32, 64, 2, 0, 4, 3), C4(16, 64, 1, 0, 4, 4), C4(32, 64, 1, 1, 4, 4),
    C4(32, 128, 2, 0, 8, 3), C4(32, 64, 1, 0, 4, 6), C4(32, 64, 1, 0, 4, 4, True),
    C4(16, 64, 1, 0, 4, 4, True), C4(32, 128, 1, 0, 4, 4, True),
]  # fmt: skip


def _copies(nbytes: int, rows: int) -> int:
    return 1 if rows > 256 else max(1, -(-L2_DEFEAT_BYTES // nbytes))


def _per_call(calls: list[Callable[[], object]]) -> float:
    """Seconds per call of one CUDA-graph replay of every call in turn."""

    def body() -> None:
        for call in calls:
            call()

    return graph_seconds(body) / len(calls)


def _fmt(config: int8_gemm.GemmConfig | int4_gemm.GemmConfig) -> str:
    return " ".join(f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config))


Summary = list[tuple[str, ...]]
"""Rows for the run's table: (what, measured, reference, tiling)."""


def tune_int8() -> Summary:
    """Time INT8's candidates per bucket against the fused three-launch path and bf16; install
    the fastest that is exact in `int8_gemm.CONFIGS`."""
    summary: Summary = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    layers = {}
    for n, k in SHAPES:
        w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8, device="cuda")
        scale = torch.rand(n, generator=gen, device="cuda") / 100
        layers[n, k] = (w, scale)
        int8_gemm.reserve(device, n)
    print("\nINT8 tilings (µs per decoder layer: the four projections; bit-exact against torch)")
    for bucket, (rows_list, candidates) in INT8_CANDIDATES.items():
        totals: dict[int, float] = {}
        bases: dict[str, float] = {"bf16": 0.0, "fused": 0.0}
        for rows in rows_list:
            base: dict[str, float] = {"bf16": 0.0, "fused": 0.0}
            times = [0.0] * len(candidates)
            for (n, k), (w, scale) in layers.items():
                copies = _copies(w.numel(), rows)
                ws = [w.clone() for _ in range(copies)]
                dense = [torch.randn(n, k, generator=gen, device="cuda").bfloat16()
                         for _ in range(copies)]  # fmt: skip
                x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
                fused = [Int8Linear(c, scale, None) for c in ws]
                for layer in fused:
                    layer.kernels = "fused"
                want = fused[0](x)
                base["bf16"] += _per_call([functools.partial(F.linear, x, d) for d in dense])
                base["fused"] += _per_call([functools.partial(f, x) for f in fused])
                for i, config in enumerate(candidates):
                    if times[i] == float("inf"):
                        continue
                    run = functools.partial(int8_gemm.matmul, x, out_dtype=torch.bfloat16,
                                            divisor=HALF_RANGE, min_scale=_MIN_SCALE,
                                            config=config)  # fmt: skip
                    try:
                        exact = torch.equal(run(ws[0], weight_scale=scale), want)
                        sec = _per_call([functools.partial(run, c, weight_scale=scale)
                                         for c in ws])  # fmt: skip
                    except Exception as e:  # a tiling that does not build on this card
                        print(f"   {_fmt(config)}: {type(e).__name__}: {str(e)[:120]}")
                        exact, sec = False, float("inf")
                    if not exact and sec != float("inf"):
                        print(f"   {_fmt(config)}: NOT the torch ops' numbers at M={rows}")
                    times[i] = times[i] + sec if exact else float("inf")
                del ws, dense, fused
            print(f"M={rows:5d} bf16 {base['bf16'] * 1e6:8.1f}  fused {base['fused'] * 1e6:8.1f}")
            for name, sec in base.items():
                bases[name] += sec
            for i, config in enumerate(candidates):
                print(f"        {times[i] * 1e6:8.1f}  {_fmt(config)}")
                totals[i] = totals.get(i, 0.0) + times[i]
        best = min(totals, key=totals.__getitem__)
        rows_str = ",".join(map(str, rows_list))
        if totals[best] < float("inf"):
            int8_gemm.CONFIGS[bucket] = candidates[best]
            print(f"bucket M<={bucket}: best {_fmt(candidates[best])} (installed)")
            summary.append((f"tune int8 M={rows_str}: best tiling, µs/layer",
                            f"{totals[best] * 1e6:.1f}",
                            f"fused {bases['fused'] * 1e6:.1f}, bf16 {bases['bf16'] * 1e6:.1f}",
                            _fmt(candidates[best])))  # fmt: skip
        else:
            summary.append((f"tune int8 M={rows_str}", "no tiling passed"))
    return summary


def tune_int4(group_size: int) -> Summary:
    """Time INT4's candidates at 1 and 16 rows against tinygemm and bf16; install the fastest
    that passes (`int4_gemm.CONFIG`: one tiling for every M)."""
    summary: Summary = []
    gen = torch.Generator().manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    totals = [0.0] * len(INT4_CANDIDATES)
    print(f"\nINT4 g{group_size} tilings (µs per decoder layer; bf16 precision, M-invariant)")
    for rows in INT4_ROWS:
        base = {"bf16": 0.0, "tinygemm": 0.0}
        times = [0.0] * len(INT4_CANDIDATES)
        for n, k in SHAPES:
            q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
            scale = torch.rand(n, k // group_size, generator=gen) / 50 + 1e-3
            packed = pack_int4(q).cuda()
            copies = _copies(packed.numel() * 4, rows)
            tiny = [Int4Linear(packed.clone(), scale.cuda(), k, group_size, None)
                    for _ in range(copies)]  # fmt: skip
            for layer in tiny:
                assert layer.kernels == "tinygemm", layer.kernels
                layer.large_m_rows = None  # tinygemm at 16 rows too
            words = [int4_gemm.interleave(packed, k) for _ in range(copies)]
            dev_scale = scale.cuda()
            dense = [torch.randn(n, k, device="cuda").bfloat16() for _ in range(copies)]
            x = torch.randn(16, k, generator=gen).bfloat16().cuda()
            w_bf16 = (q.float().view(n, -1, group_size) * scale.unsqueeze(-1)).view(n, k)
            exact, bound = int4_gemm.product_bound(x, w_bf16.bfloat16().cuda())
            base["bf16"] += _per_call([functools.partial(F.linear, x[:rows], d) for d in dense])
            base["tinygemm"] += _per_call([functools.partial(t, x[:rows]) for t in tiny])
            for i, config in enumerate(INT4_CANDIDATES):
                if times[i] == float("inf"):
                    continue
                run = functools.partial(int4_gemm.matmul, scale=dev_scale,
                                        group_size=group_size, config=config)  # fmt: skip
                try:
                    int4_gemm.reserve(device, n, k, config)
                    out = run(x, words[0])
                    ok = torch.equal(run(x[:1], words[0])[0], out[0])
                    ok = ok and bool(((out.double() - exact).abs() <= bound).all())
                    sec = _per_call([functools.partial(run, x[:rows], c) for c in words])
                except Exception as e:  # a tiling that does not build on this card
                    print(f"   {_fmt(config)}: {type(e).__name__}: {str(e)[:120]}")
                    ok, sec = False, float("inf")
                if not ok and sec != float("inf"):
                    print(f"   {_fmt(config)}: off the bf16 product or not M-invariant")
                times[i] = times[i] + sec if ok else float("inf")
            del tiny, words, dense, exact, bound
        print(f"M={rows:5d} bf16 {base['bf16'] * 1e6:8.1f}  tinygemm {base['tinygemm'] * 1e6:8.1f}")
        for i, config in enumerate(INT4_CANDIDATES):
            print(f"        {times[i] * 1e6:8.1f}  {_fmt(config)}")
            totals[i] += times[i]
        fastest = min(times)
        reference = f"tinygemm {base['tinygemm'] * 1e6:.1f}, bf16 {base['bf16'] * 1e6:.1f}"
        summary.append(
            (f"tune int4 g{group_size} M={rows}: best tiling, µs/layer", f"{fastest * 1e6:.1f}",
             reference)
        )  # fmt: skip
    best = min(range(len(totals)), key=totals.__getitem__)
    if totals[best] < float("inf"):
        int4_gemm.CONFIG = INT4_CANDIDATES[best]
        print(f"int4: best {_fmt(INT4_CANDIDATES[best])} (installed)")
        summary.append(("tune int4 installed", _fmt(INT4_CANDIDATES[best])))
    return summary


def tune(group_size: int) -> Summary:
    """Both tunes (module docstring); the rows for the run's table."""
    summary = tune_int8() + tune_int4(group_size)
    torch.cuda.empty_cache()
    return summary
