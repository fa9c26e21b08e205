"""Timing helpers the GPU kernel benchmarks share: the HBM copy rate (the floor every decode
figure is judged against), the time of a body of launches replayed as one CUDA graph (as
serving runs them: no launch overhead between kernels), and random KV to time them over."""

from __future__ import annotations

from collections.abc import Callable

import torch


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


def fill_random(tensor: torch.Tensor, bound: float) -> None:
    """Normal values clamped to ±bound, in the tensor's dtype (e4m3 included), a 2^28-element
    slice at a time: a 20 GB pool needs no float32 temporary of four times its size."""
    flat = tensor.view(-1)
    for i in range(0, flat.numel(), 1 << 28):
        part = flat[i : i + (1 << 28)]
        part.copy_(torch.randn(part.shape, device=tensor.device).clamp(-bound, bound))


def graph_seconds(body: Callable[[], object], iters: int = 20) -> float:
    """Seconds per replay of one CUDA-graph capture of body() (run once eagerly first, so
    kernels compile and allocations settle outside the capture)."""
    body()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters
