"""The INT8 and INT4 linear layers on CUDA compute what their CPU path computes: INT8's
`torch._int_mm` (padded below 17 rows; dims off the multiple of 8 in float64) is exact in
int32, so only the bf16 output rounds; INT4's PyTorch int4 GEMM (`_weight_int4pack_mm`, bf16
scales) and its dequantized fallback agree with the CPU's group-wise dequantized matmul to
bf16 precision. The Triton kernels (engine/quantization/int8_gemm.py, int4_gemm.py): INT8 bit
for bit with the torch ops, INT4 within bf16 GEMM precision of the exact product with a row's
numbers independent of the batch, both replayed from a CUDA graph with eager's numbers."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from engine.quantization import int4_gemm, int4_kernels, int8_gemm
from engine.quantization.int4_linear import Int4Linear, pack_int4, quantize_groups_int4
from engine.quantization.int8_linear import (
    Int8Linear,
    auto_kernels,
    fused_ready,
    fused_verified,
    quantize_rows_int8,
    triton_ready,
    triton_verified,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    rows = want.abs().amax(dim=1, keepdim=True)
    worst = float(((got.float() - want.float()).abs() / rows).max())
    assert worst <= rel, worst


@pytest.mark.parametrize("m", [1, 16, 17, 300])
@pytest.mark.parametrize("shape", [(512, 256), (520, 264)])  # the second: float64 fallback
def test_int8_linear_on_cuda_equals_the_cpu_path(m: int, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(m)
    w = torch.randn(*shape, generator=g)
    q, scale = quantize_rows_int8(w, 127.0)
    b = torch.randn(shape[0], generator=g)
    x = torch.randn(m, shape[1], generator=g)
    x[0] *= 1000.0  # per-token scales: the loud row leaves the others alone
    cpu = Int8Linear(q, scale.reshape(-1), b)(x, out_dtype=torch.float32)
    gpu = Int8Linear(q.cuda(), scale.reshape(-1).cuda(), b.cuda().bfloat16())
    got = gpu(x.cuda().bfloat16(), out_dtype=torch.float32).cpu()
    _close(got, cpu, 2e-2)  # x rounded to bf16 before it is quantized, the output to bf16


@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_linear_on_cuda_equals_the_cpu_path(m: int, group_size: int) -> None:
    g = torch.Generator().manual_seed(m + group_size)
    w = torch.randn(512, 256, generator=g)
    q, scale = quantize_groups_int4(w, group_size)
    packed = pack_int4(q)
    x = torch.randn(m, 256, generator=g).bfloat16()
    cpu = Int4Linear(packed, scale, 256, group_size, None)(x.float(), out_dtype=torch.float32)
    gpu = Int4Linear(packed.cuda(), scale.cuda(), 256, group_size, None)
    assert gpu._tinygemm is not None  # the int4 GEMM, not the fallback, on this shape
    _close(gpu(x.cuda()).cpu(), cpu, 2e-2)  # bf16 scales and output


def test_int4_keeps_one_copy_of_its_weight_on_the_device() -> None:
    """With the int4 GEMM's repacked weight made, the packed weight lives on the host: the
    device holds the int4 bytes once; an input of another dtype still computes (dequantized
    from the host copy)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(1024, 512, generator=g)
    q, scale = quantize_groups_int4(w, 128)
    packed = pack_int4(q).cuda()
    cuda = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() - int4_kernels.workspace_bytes(cuda)
    gpu = Int4Linear(packed, scale.cuda(), 512, 128, None)
    del packed
    torch.cuda.synchronize()
    assert gpu._tinygemm is not None
    assert gpu.weight_packed.device.type == "cpu"
    # the shared large-M workspace (one per device, not per layer) aside
    held = torch.cuda.memory_allocated() - int4_kernels.workspace_bytes(cuda) - before
    assert held <= gpu.nbytes + 2 * scale.numel() * 4 + 2**16  # + float32 and bf16 scales
    x = torch.randn(5, 512, generator=g)
    cpu = Int4Linear(pack_int4(q), scale, 512, 128, None)(x, out_dtype=torch.float32)
    _close(gpu(x.cuda(), out_dtype=torch.float32).cpu(), cpu, 1e-5)  # float32: dequantized


def test_tinygemm_repacks_into_the_layout_the_dequantize_kernel_reads() -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-8, 8, (64, 512), generator=g, dtype=torch.int8)
    u = (q.to(torch.int32) + 8).to(torch.uint8).cuda()
    packed = torch._convert_weight_to_int4pack((u[:, ::2] << 4 | u[:, 1::2]).contiguous(), 8)
    assert torch.equal(packed.cpu(), int4_kernels.encode_tinygemm(q))
    assert int4_kernels.layout_verified(torch.device("cuda", torch.cuda.current_device()))


@pytest.mark.parametrize("m", [1, 33, 300])
def test_int4_large_m_path_writes_the_cpu_weight_and_equals_the_cpu_path(m: int) -> None:
    g = torch.Generator().manual_seed(m)
    w = torch.randn(1024, 512, generator=g)
    q, scale = quantize_groups_int4(w, 128)
    cpu = Int4Linear(pack_int4(q), scale, 512, 128, None)
    gpu = Int4Linear(pack_int4(q).cuda(), scale.cuda(), 512, 128, None)
    assert gpu.large_m_rows is not None
    gpu.large_m_rows = 1  # every size dequantizes
    out = torch.empty(1024, 512, dtype=torch.bfloat16, device="cuda")
    assert gpu._tinygemm is not None
    int4_kernels.dequantize(gpu._tinygemm[0], gpu.weight_scale, 128, out)
    assert torch.equal(out.cpu(), cpu.dequantized(torch.bfloat16))  # bit for bit
    x = torch.randn(m, 512, generator=g).bfloat16()
    want = cpu(x.float(), out_dtype=torch.float32)
    _close(gpu(x.cuda(), out_dtype=torch.float32).cpu(), want, 1e-2)  # bf16 x W, bf16 out


def test_int4_large_m_path_replays_in_a_cuda_graph() -> None:
    g = torch.Generator().manual_seed(5)
    q, scale = quantize_groups_int4(torch.randn(1024, 512, generator=g), 128)
    gpu = Int4Linear(pack_int4(q).cuda(), scale.cuda(), 512, 128, None)
    gpu.large_m_rows = 16
    x = torch.randn(64, 512, generator=g).bfloat16().cuda()
    eager = gpu(x)  # compiles the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gpu(x)
    x.copy_(torch.randn(64, 512, generator=g).bfloat16())
    graph.replay()
    assert not torch.equal(out, eager)
    _close(out.float(), gpu(x).float(), 1e-2)


@pytest.mark.parametrize("m", [1, 16, 17, 300])
def test_int8_fused_kernels_give_the_torch_ops_numbers_also_in_a_cuda_graph(m: int) -> None:
    """The three-launch path (engine/quantization/int8_kernels.py) against the torch ops on
    the same device, bit for bit: eager, and replayed from a CUDA graph."""
    device = torch.device("cuda")
    assert fused_verified(device) and fused_ready(device)
    g = torch.Generator().manual_seed(m)
    q, scale = quantize_rows_int8(torch.randn(1024, 512, generator=g), 127.0)
    layer = Int8Linear(q.cuda(), scale.reshape(-1).cuda(), None)
    x = torch.randn(m, 512, generator=g).cuda().bfloat16()
    x[0] *= 1000.0
    layer.kernels = "torch"
    want = layer(x)
    layer.kernels = "fused"
    assert torch.equal(layer(x), want)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x)  # warm: the kernels build outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def _graphed(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(graph, its output) of fn() captured after one warm call on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # the kernels build outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("m", [1, 3, 16, 17, 40, 300])
@pytest.mark.parametrize("shape", [(1024, 512), (520, 264), (4096, 4096)])
def test_int8_triton_gemm_gives_the_torch_ops_numbers_also_in_a_cuda_graph(
    m: int, shape: tuple[int, int]
) -> None:
    """One launch (two from 17 rows) against the torch ops on the same device, bit for bit:
    eager, then replayed twice from a CUDA graph over new inputs (the split-K counters and
    partial sums reset by each call)."""
    device = torch.device("cuda", torch.cuda.current_device())
    assert triton_verified(device) and triton_ready(device)
    g = torch.Generator().manual_seed(m)
    q, scale = quantize_rows_int8(torch.randn(*shape, generator=g), 127.0)
    layer = Int8Linear(q.cuda(), scale.reshape(-1).cuda(), None)
    x = torch.randn(m, shape[1], generator=g).cuda().bfloat16()
    x[0] *= 1000.0

    def want() -> torch.Tensor:
        layer.kernels = "torch"
        out = layer(x)
        layer.kernels = "triton"
        return out

    layer.kernels = "triton"
    assert torch.equal(layer(x), want())
    graph, out = _graphed(lambda: layer(x))
    for _ in range(2):
        x.copy_(torch.randn(m, shape[1], generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want())
    acc, counters = int8_gemm._WORKSPACES[device]
    assert not acc.any() and not counters.any()


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("shape", [(1024, 512), (4096, 4096), (520, 384)])
def test_int4_triton_gemm_is_the_bf16_product_and_independent_of_the_batch(
    group_size: int, shape: tuple[int, int]
) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    assert int4_gemm.triton_ready(device)
    g = torch.Generator().manual_seed(group_size)
    q, scale = quantize_groups_int4(torch.randn(*shape, generator=g), group_size)
    cpu = Int4Linear(pack_int4(q), scale, shape[1], group_size, None)
    gpu = Int4Linear(pack_int4(q).cuda(), scale.cuda(), shape[1], group_size, None)
    assert gpu.use_kernels("triton") == "triton"
    w = cpu.dequantized(torch.bfloat16)
    x = torch.randn(31, shape[1], generator=g).bfloat16()
    x[2] *= 100.0
    outs = {m: gpu(x[:m].cuda()).cpu() for m in (1, 7, 16, 31)}
    for m, out in outs.items():
        assert torch.equal(out[0], outs[1][0])  # row 0 whatever the batch, bit for bit
        assert torch.equal(out, outs[31][:m])  # every row
        assert int4_gemm.within_tolerance(out, x[:m], w)
    assert torch.equal(gpu(x.cuda()).cpu(), outs[31])  # run to run
    # tinygemm rounds the scales to bf16: near, not equal
    assert gpu.use_kernels("tinygemm") == "tinygemm"
    _close(gpu(x[:7].cuda()).cpu(), outs[7], 2e-2)


def test_int4_triton_path_replays_in_a_cuda_graph_and_keeps_one_weight_copy() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(9)
    q, scale = quantize_groups_int4(torch.randn(4096, 4096, generator=g), 128)
    packed = pack_int4(q).cuda()
    torch.cuda.synchronize()
    spare = int4_kernels.workspace_bytes(device) + int4_gemm.workspace_bytes(device)
    before = torch.cuda.memory_allocated() - spare
    gpu = Int4Linear(packed, scale.cuda(), 4096, 128, None)
    assert gpu.use_kernels("triton") == "triton"
    del packed
    torch.cuda.synchronize()
    spare = int4_kernels.workspace_bytes(device) + int4_gemm.workspace_bytes(device)
    held = torch.cuda.memory_allocated() - spare - before
    assert gpu.weight_packed.device.type == "cpu" and gpu._tinygemm is None
    assert held <= gpu.nbytes + scale.numel() * 4 + 2**16  # the layout + float32 scales

    def same(got: torch.Tensor, want: torch.Tensor) -> None:
        if got.shape[0] < 32:  # the Triton GEMM: bit for bit
            assert torch.equal(got, want)
        else:  # the large-M path: cuBLAS may pick another algorithm in the capture
            _close(got.float(), want.float(), 1e-2)

    for m in (1, 16, 64):  # 64: the large-M path (dequantize, cuBLAS) reads the same layout
        x = torch.randn(m, 4096, generator=g).bfloat16().cuda()
        eager = gpu(x)
        graph, out = _graphed(functools.partial(gpu, x))
        graph.replay()
        torch.cuda.synchronize()
        same(out, eager)
        x.copy_(torch.randn(m, 4096, generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        same(out, gpu(x))
    words = gpu._interleaved
    assert words is not None
    out = torch.empty(4096, 4096, dtype=torch.bfloat16, device="cuda")
    int4_gemm.dequantize(words, gpu.weight_scale, 128, out)
    cpu = Int4Linear(pack_int4(q), scale, 4096, 128, None)
    assert torch.equal(out.cpu(), cpu.dequantized(torch.bfloat16))  # bit for bit
    assert not int4_gemm._WORKSPACES[device][1].any()


@pytest.mark.parametrize(
    "config",
    [
        int8_gemm.GemmConfig(16, 64, 256, 0, 1, 4, 4, True, swap_ab=True),
        int8_gemm.GemmConfig(16, 64, 256, 4, 1, 4, 4, False),
        int8_gemm.GemmConfig(64, 64, 128, 0, 1, 4, 4, False, swap_ab=True),
        int8_gemm.GemmConfig(128, 256, 128, 1, 8, 8, 3, False),
    ],
)
def test_int8_triton_tilings_the_tune_may_pick_are_bit_exact(config: int8_gemm.GemmConfig) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(1)
    q, scale = quantize_rows_int8(torch.randn(4096, 1536, generator=g), 127.0)
    layer = Int8Linear(q.cuda(), scale.reshape(-1).cuda(), None)
    layer.kernels = "torch"
    for m in (1, 16, 64, 300):
        x = torch.randn(m, 1536, generator=g).bfloat16().cuda()
        got = int8_gemm.matmul(x, layer.weight, layer.weight_scale, torch.bfloat16, 127.5,
                               torch.finfo(torch.float32).eps, config)  # fmt: skip
        assert torch.equal(got, layer(x)), m
    assert not int8_gemm._WORKSPACES[device][0].any()


@pytest.mark.parametrize(
    "config",
    [
        int4_gemm.GemmConfig(32, 64, 1, 0, 4, 4, swap_ab=True),
        int4_gemm.GemmConfig(16, 64, 1, 1, 4, 4, swap_ab=True),
        int4_gemm.GemmConfig(32, 128, 2, 0, 8, 3),
    ],
)
def test_int4_triton_tilings_the_tune_may_pick_are_near_and_batch_independent(
    config: int4_gemm.GemmConfig,
) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(2)
    q, scale = quantize_groups_int4(torch.randn(4096, 2048, generator=g), 128)
    words = int4_gemm.interleave(pack_int4(q).cuda(), 2048)
    int4_gemm.reserve(device, 4096, 2048, config)
    w = (q.float().view(4096, -1, 128) * scale.unsqueeze(-1)).view(4096, 2048).bfloat16()
    x = torch.randn(31, 2048, generator=g).bfloat16()
    wide = int4_gemm.matmul(x.cuda(), words, scale.cuda(), 128, config).cpu()
    assert int4_gemm.within_tolerance(wide, x, w)
    for m in (1, 5, 16):
        assert torch.equal(int4_gemm.matmul(x[:m].cuda(), words, scale.cuda(), 128, config).cpu(),
                           wide[:m])  # fmt: skip


@pytest.mark.parametrize("m", [1, 8, 9, 64, 255, 256, 1500])
def test_int8_auto_gives_the_torch_ops_numbers_on_either_side_of_its_row_thresholds(m: int) -> None:
    """'auto' (the default) runs the Triton GEMM or the fused kernels by the rows
    (`auto_kernels`): the same numbers as the torch ops either way, so a request's tokens do
    not depend on its batch."""
    device = torch.device("cuda", torch.cuda.current_device())
    assert triton_ready(device) and fused_ready(device)
    g = torch.Generator().manual_seed(m)
    q, scale = quantize_rows_int8(torch.randn(1024, 512, generator=g), 127.0)
    layer = Int8Linear(q.cuda(), scale.reshape(-1).cuda(), None)
    assert layer.kernels == "auto"
    x = torch.randn(m, 512, generator=g).cuda().bfloat16()
    got = layer(x)
    layer.kernels = "torch"
    assert torch.equal(got, layer(x)), auto_kernels(m)
