"""FP8 on the GPU past the GEMM: the fused ops that write e4m3 (flashinfer's RMSNorm → e4m3,
the triton SiLU·mul → e4m3 and cast) against the torch composition, inside a CUDA graph too;
flashinfer attention over an e4m3 KV pool against the torch reference over the same pool
(prefill, decode and CUDA-graph decode); and the tiny model served with FP8 weights + FP8 KV
through the engine, greedy equal to bf16's but at near-ties (the margin rule of
tests/integration/engine/test_engine_fp8.py, <= for bf16's coarse logits)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fp8_reference import GPU_GREEDY, GPU_TEXTS, greedy_margin_check, rounded_to_e4m3_per_head

from engine.attention import build_layout, create_backend, stage_once
from engine.attention.triton_decode import (
    DecodeTiles,
    NewKV,
    PagedDecode,
    Rope,
    reference_decode,
)
from engine.batch import ScheduledBatch, SeqChunk
from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.kv.kv_cache import BLOCK_MAJOR, KV_LAYOUT, LAYER_MAJOR, KVCache
from engine.kv.kv_sizing import kv_cache_spec
from engine.loading.loaders import load_model
from engine.modeling.layer_ops import TORCH_OPS, FlashInferOps
from engine.modeling.llama import LlamaModel, Rotary
from engine.quantization.fp8_linear import FP8_DTYPE, quantize_static
from vocabulary.model_config import ModelConfig

pytestmark = pytest.mark.gpu

BS = 16


def _dq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.float() * scale


def _close_e4m3(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> None:
    """Equal e4m3 codes but where rounding an input one bf16 ulp apart lands on the next
    code: at most one e4m3 step (2^-3 relative) and on a small share of the elements."""
    assert got.dtype == want.dtype == FP8_DTYPE and got.shape == want.shape
    g, w = _dq(got, scale), _dq(want, scale)
    differs = g != w
    assert float(differs.float().mean()) < 0.05
    step = w.abs().clamp_min(float(scale) * 2**-6) * 2**-3
    assert bool(((g - w).abs() <= step * 1.001).all())


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_fused_fp8_ops_equal_the_torch_composition(rows: int) -> None:
    ops = FlashInferOps()
    g = torch.Generator(device="cuda").manual_seed(rows)
    h, inter = 512, 1024
    x = torch.randn(rows, h, device="cuda", generator=g).bfloat16()
    r = torch.randn(rows, h, device="cuda", generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).bfloat16()
    gu = torch.randn(rows, 2 * inter, device="cuda", generator=g).bfloat16()
    scale = torch.tensor(2.0**-5, device="cuda")
    _close_e4m3(
        ops.rms_norm_quant(x, w, 1e-6, scale), TORCH_OPS.rms_norm_quant(x, w, 1e-6, scale), scale
    )
    want_q, want_r = TORCH_OPS.add_rms_norm_quant(x.clone(), r.clone(), w, 1e-6, scale)
    got_q, got_r = ops.add_rms_norm_quant(x.clone(), r.clone(), w, 1e-6, scale)
    _close_e4m3(got_q, want_q, scale)
    assert torch.equal(got_r, want_r)
    _close_e4m3(ops.silu_and_mul_quant(gu, scale), TORCH_OPS.silu_and_mul_quant(gu, scale), scale)
    _close_e4m3(ops.quantize(x * 100, scale), quantize_static(x * 100, scale), scale)  # saturates


def test_fused_fp8_ops_replay_in_a_cuda_graph() -> None:
    ops = FlashInferOps()
    x = torch.randn(8, 256, device="cuda").bfloat16()
    scale = torch.tensor(2.0**-6, device="cuda")
    ops.silu_and_mul_quant(x, scale)  # JIT outside the capture
    ops.quantize(x, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a = ops.silu_and_mul_quant(x, scale)
        b = ops.quantize(x, scale)
    x.mul_(2)
    graph.replay()
    _close_e4m3(a, TORCH_OPS.silu_and_mul_quant(x, scale), scale)
    _close_e4m3(b, quantize_static(x, scale), scale)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from deploy.checkpoints.make_model import make_model

    out = tmp_path_factory.mktemp("tiny-bf16-fp8") / "model"
    return make_model(out, preset="tiny", num_layers=2, torch_dtype="bfloat16", hidden_size=256)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> LlamaModel:
    return load_model(model_dir, torch.bfloat16, "cuda")


def _xqa_is_autos_choice() -> bool:
    """auto takes XQA for an e4m3 pool on SM90 where it builds (flashinfer_backend)."""
    from engine.attention.xqa_decode import xqa_unavailable_reason

    device = torch.device("cuda")
    sm90 = torch.cuda.get_device_capability()[0] == 9
    return sm90 and xqa_unavailable_reason(device, BS, 64) is None


def _fp8_pool(model: LlamaModel, layout: str = KV_LAYOUT) -> KVCache:
    scales = tuple(2.0**-4 if i % 2 else 2.0**-3 for i in range(2 * model.cfg.num_layers))
    spec = kv_cache_spec(model.cfg, BS, FP8_DTYPE, 64, scales, layout=layout)
    return KVCache(spec, "cuda")


@pytest.mark.parametrize(
    ("decode", "tolerance"), [("flashinfer", 2e-2), ("triton", 2e-2), ("xqa", 5e-2)]
)
def test_flashinfer_attention_over_an_e4m3_pool_equals_torch_over_the_same_pool(
    model: LlamaModel, decode: str, tolerance: float
) -> None:
    """Relative error of the output against float32 torch over the same pool; XQA rounds q
    to e4m3 for its FP8 scores (3 mantissa bits), hence its looser bound."""
    cfg = model.cfg
    fi_pool, ref_pool = _fp8_pool(model), _fp8_pool(model)
    fi = create_backend("flashinfer", cfg, fi_pool, torch.bfloat16, decode_attention=decode)
    assert getattr(fi, "decode_kernel", None) == decode
    ref = create_backend("torch", cfg, ref_pool, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)

    def c(rid: str, n: int, start: int, blocks: tuple[int, ...]) -> SeqChunk:
        return SeqChunk(rid, (1,) * n, start, blocks, True)

    steps = [  # prompts, then a chunk over a cached prefix beside a decode, then decodes
        ScheduledBatch((c("a", 40, 0, (1, 2, 3)), c("b", 20, 0, (4, 5)))),
        ScheduledBatch((c("a", 8, 40, (1, 2, 3, 6)), c("b", 1, 20, (4, 5)))),
        ScheduledBatch((c("a", 1, 48, (1, 2, 3, 6)), c("b", 1, 21, (4, 5)))),
    ]
    for batch in steps:
        step = stage_once(build_layout(batch, BS), "cuda")
        fi.prepare(step)
        ref.prepare(step)
        t = step.input_ids.shape[0]
        for layer in range(cfg.num_layers):
            q = torch.randn(t, cfg.num_heads, cfg.head_dim, device="cuda", generator=g).bfloat16()
            k = torch.randn(
                t, cfg.num_kv_heads, cfg.head_dim, device="cuda", generator=g
            ).bfloat16()
            v = torch.randn(
                t, cfg.num_kv_heads, cfg.head_dim, device="cuda", generator=g
            ).bfloat16()
            got, want = fi.forward(layer, q, k, v), ref.forward(layer, q, k, v)
            err = float((got.float() - want.float()).norm() / want.float().norm())
            assert err < tolerance, (layer, err)
    assert torch.equal(fi_pool.tensor.view(torch.uint8), ref_pool.tensor.view(torch.uint8))


@pytest.mark.parametrize("layout", [BLOCK_MAJOR, LAYER_MAJOR])
def test_fused_kv_store_writes_what_the_composed_ops_write(model: LlamaModel, layout: str) -> None:
    from engine.quantization import fp8_kernels

    cfg = model.cfg
    pool = _fp8_pool(model, layout)
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(9, cfg.q_size + 2 * cfg.kv_size, device="cuda", generator=g).bfloat16()
    k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(9, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[:, cfg.q_size + cfg.kv_size :].view(9, cfg.num_kv_heads, cfg.head_dim)
    blocks = torch.tensor([3, 3, 5, 7, 7, 7, 9, 9, 1], device="cuda", dtype=torch.int32)
    offsets = torch.tensor([0, 1, 15, 2, 3, 4, 8, 9, 0], device="cuda", dtype=torch.int32)
    layer = cfg.num_layers - 1
    ks, vs = pool.spec.layer_scales(layer)
    fp8_kernels.store_kv(pool.layer(layer), blocks, offsets, k, v, (ks, vs))
    want = torch.zeros_like(pool.tensor)
    view = want[layer] if layout == LAYER_MAJOR else want[:, layer]
    view[:, 0].index_put_((blocks.long(), offsets.long()), quantize_static(k, ks))
    view[:, 1].index_put_((blocks.long(), offsets.long()), quantize_static(v, vs))
    assert torch.equal(pool.tensor.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize(
    ("quantization", "kv_cache_dtype", "decode_attention", "kv_layout"),
    [
        ("fp8", "fp8", "auto", "auto"),
        ("none", "fp8", "auto", "auto"),
        ("fp8", "fp8", "triton-e4m3-scores", "auto"),
        ("fp8", "fp8", "xqa", "auto"),
        ("fp8", "fp8", "triton", "auto"),
        ("fp8", "fp8", "auto", "layer_major"),
        ("fp8", "fp8", "triton", "layer_major"),
    ],
)
def test_fp8_kv_greedy_through_cuda_graphs_equals_bf16_but_at_near_ties(
    model_dir: Path, quantization: str, kv_cache_dtype: str, decode_attention: str,
    kv_layout: str,
) -> None:  # fmt: skip
    # head_dim 64: flashinfer attention and CUDA-graph decode (the default tiny model's 32
    # takes the torch backend)
    base = dict(model_dir=str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=256)
    dense = LLMEngine(EngineConfig(**base))  # type: ignore[arg-type]
    fp8 = LLMEngine(
        EngineConfig(
            **base,  # type: ignore[arg-type]
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            decode_attention=decode_attention,
            kv_layout=kv_layout,
        )
    )
    assert fp8.kv_cache.tensor.dtype == FP8_DTYPE
    assert kv_layout == "auto" or fp8.kv_cache.spec.layout == LAYER_MAJOR
    assert fp8.runner.graphs is not None  # the CUDA-graph decode path serves it
    xqa = decode_attention == "xqa" or (decode_attention == "auto" and _xqa_is_autos_choice())
    kernel = "xqa" if xqa else "triton"
    assert getattr(fp8.runner.backend, "decode_kernel", None) == kernel
    prompts = [dense.tokenizer.encode(text) for text in GPU_TEXTS]
    assert greedy_margin_check(dense, fp8, prompts, GPU_GREEDY, inclusive=True).exact >= 1


@pytest.mark.parametrize(
    "tiles",
    [
        DecodeTiles(),
        DecodeTiles(heads_first=False),
        DecodeTiles(64, 4, 2),
        DecodeTiles(scores_fp8=True),
        DecodeTiles(64, 4, 3, scores_fp8=True),
    ],
)
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_decode_variants_and_e4m3_output(tiles: DecodeTiles, splits: int) -> None:
    """Every launch variant of the Triton decode equals the float32 reference over an e4m3
    pool (with e4m3 scores, the reference over q rounded to e4m3 per head); its e4m3 output
    (o_proj's input) is its float output / out_scale in e4m3, as the separate cast would
    write it (within one e4m3 step where bf16 rounding tips it)."""
    g = torch.Generator(device="cuda").manual_seed(splits)
    lens, page, kv_heads, heads, dim = [1, 17, 300, 1029, 64], 16, 8, 64, 128
    num_pages = [-(-n // page) for n in lens]
    blocks = sum(num_pages) + 5
    pool = torch.randn(blocks, 2, page, kv_heads, dim, device="cuda", generator=g)
    kv = pool.clamp(-4, 4).to(FP8_DTYPE)
    order = torch.randperm(blocks, device="cuda", generator=g)[: sum(num_pages)].int()
    indptr = torch.tensor([0, *torch.tensor(num_pages).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, num_pages, strict=True)])
    q = torch.randn(len(lens), heads, dim, device="cuda", generator=g).bfloat16()
    kernel = PagedDecode(len(lens), heads, kv_heads, dim, page, q.device, splits, tiles)
    args = (q, kv, order, indptr.cuda(), last.int().cuda(), dim**-0.5, 0.05, 0.07)
    got = kernel.run(*args)
    q_seen = rounded_to_e4m3_per_head(q) if tiles.scores_fp8 else q
    want = reference_decode(q_seen, kv, order, indptr, last.int(), dim**-0.5, 0.05, 0.07)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)
    scale = torch.tensor(2.0**-6, device="cuda")
    as_e4m3 = kernel.run(*args, out_scale=scale)
    _close_e4m3(as_e4m3, quantize_static(got, scale), scale)


@dataclass(frozen=True)
class GraphDecode:
    """Four sequences over an e4m3 pool (pages in random order) as a CUDA-graph decode step
    sees them: page arrays, each sequence's last-token slot and position, and a qkv output."""

    pool: torch.Tensor  # [blocks, layers, 2, page, kv_heads, dim]
    args: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float, float]
    """PagedDecode.run's arguments after q and the pool view."""
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    positions: torch.Tensor
    qkv: torch.Tensor  # [4, heads + 2 kv_heads, dim], bf16

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        heads = qkv.shape[1] - 16
        return qkv[:, :heads], qkv[:, heads : heads + 8], qkv[:, heads + 8 :]


def _graph_decode(seed: int, layers: int, heads: int = 64) -> GraphDecode:
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens, page, kv_heads, dim = [5, 17, 300, 1029], 16, 8, 128
    num_pages = [-(-n // page) for n in lens]
    blocks = sum(num_pages) + 5
    pool = torch.randn(blocks, layers, 2, page, kv_heads, dim, device="cuda", generator=g)
    order = torch.randperm(blocks, device="cuda", generator=g)[: sum(num_pages)].int()
    indptr = torch.tensor([0, *torch.tensor(num_pages).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, num_pages, strict=True)])
    ends = torch.tensor(lens) - 1
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, dim, device="cuda", generator=g)
    return GraphDecode(
        pool=pool.clamp(-4, 4).to(FP8_DTYPE),
        args=(order, indptr.cuda(), last.int().cuda(), dim**-0.5, 0.05, 0.07),
        slot_blocks=order[indptr[:-1].long().cuda() + (ends // page).cuda()].contiguous(),
        slot_offsets=(ends % page).int().cuda(),
        positions=ends.int().cuda(),
        qkv=qkv.bfloat16(),
    )


def _rotary_70b() -> Rotary:
    """Llama-3-70B's RoPE (64/8 heads of 128, theta 500000) on the GPU."""
    cfg = ModelConfig.from_dict(
        {"model_type": "llama", "hidden_size": 8192, "num_attention_heads": 64,
         "num_key_value_heads": 8, "intermediate_size": 64, "num_hidden_layers": 1,
         "vocab_size": 32, "max_position_embeddings": 4096, "rope_theta": 500000.0}
    )  # fmt: skip
    return Rotary(cfg, torch.device("cuda"))


@pytest.mark.parametrize("splits", [1, 4])
def test_triton_decode_stores_the_new_kv_as_the_store_kernel_does(splits: int) -> None:
    """One launch that stores the step's k/v and attends (the CUDA-graph path) leaves the
    pool bit-equal to the fused store kernel followed by the attention, and the same output
    within float32 summation order (the launch adds the new token's term after its loop)."""
    from engine.quantization.fp8_kernels import store_kv

    case = _graph_decode(10 + splits, layers=2)
    q, k, v = case.split(case.qkv)
    rows = torch.arange(q.shape[0], dtype=torch.int32, device="cuda")
    kernel = PagedDecode(q.shape[0], q.shape[1], 8, 128, 16, q.device, splits)
    composed = case.pool.clone()
    store_kv(composed[:, 1], case.slot_blocks, case.slot_offsets, k, v, (0.05, 0.07))
    want = kernel.run(q, composed[:, 1], *case.args)
    new_kv = NewKV(k, v, rows, case.slot_blocks, case.slot_offsets)
    got = kernel.run(q, case.pool[:, 1], *case.args, new_kv=new_kv)
    assert torch.equal(case.pool.view(torch.uint8), composed.view(torch.uint8))
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=2e-3)


def test_triton_decode_rotates_q_and_the_new_k_as_flashinfer_rope_does() -> None:
    """Rope in the launch (the CUDA-graph path when the backend takes `graph_rope`) against
    flashinfer's RoPE kernel, the store kernel and the plain launch: the same e4m3 codes but
    where rounding the rotated k to bf16 first (flashinfer) tips one, and the same output
    within bf16's rounding."""
    from engine.quantization.fp8_kernels import store_kv

    rotary = _rotary_70b()
    case = _graph_decode(3, layers=1)
    rows = torch.arange(case.qkv.shape[0], dtype=torch.int32, device="cuda")
    kernel = PagedDecode(case.qkv.shape[0], 64, 8, 128, 16, case.qkv.device, 1)
    composed, ref_qkv = case.pool.clone(), case.qkv.clone()
    q, k, v = case.split(ref_qkv)
    FlashInferOps().rope(case.positions, q, k, rotary)
    store_kv(composed[:, 0], case.slot_blocks, case.slot_offsets, k, v, (0.05, 0.07))
    want = kernel.run(q, composed[:, 0], *case.args)
    q, k, v = case.split(case.qkv)
    new_kv = NewKV(k, v, rows, case.slot_blocks, case.slot_offsets)
    rope = Rope(rotary.cos_sin_cache, case.positions)
    got = kernel.run(q, case.pool[:, 0], *case.args, new_kv=new_kv, rope=rope)
    _close_e4m3(case.pool, composed, torch.tensor(1.0, device="cuda"))
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)


def test_xqa_graph_prologue_stores_what_the_triton_launch_stores() -> None:
    """The XQA graph step's prologue (decode_prologue.py) leaves the pool bit-equal to the
    Triton graph launch (NewKV + Rope: the same float32 rotation and rounding), and its q is
    flashinfer's RoPE of q within bf16 rounding; XQA's e4m3 output (o_proj's input) is its
    bf16 output / out_scale in e4m3, within one e4m3 step where bf16 rounding tips it."""
    from engine.attention.decode_prologue import decode_prologue
    from engine.attention.xqa_decode import XqaDecode, xqa_unavailable_reason

    device = torch.device("cuda")
    if (why := xqa_unavailable_reason(device)) is not None:
        pytest.skip(why)
    rotary = _rotary_70b()
    case = _graph_decode(4, layers=1)
    order, indptr, last, sm_scale, k_scale, v_scale = case.args
    rows = torch.arange(case.qkv.shape[0], dtype=torch.int32, device="cuda")
    rope = Rope(rotary.cos_sin_cache, case.positions)
    q, k, v = case.split(case.qkv)
    new_kv = NewKV(k, v, rows, case.slot_blocks, case.slot_offsets)
    triton_pool = case.pool.clone()
    kernel = PagedDecode(q.shape[0], 64, 8, 128, 16, device, 1)
    kernel.run(q, triton_pool[:, 0], *case.args, new_kv=new_kv, rope=rope)
    q_in = decode_prologue(q, new_kv, case.pool[:, 0], k_scale, v_scale, rope)
    assert torch.equal(case.pool.view(torch.uint8), triton_pool.view(torch.uint8))
    ref_q, ref_k, _ = case.split(case.qkv.clone())
    FlashInferOps().rope(case.positions, ref_q, ref_k, rotary)
    torch.testing.assert_close(q_in, ref_q.contiguous(), rtol=1.6e-2, atol=1e-2)

    xqa = XqaDecode(device, 16)
    max_pages = int((indptr[1:] - indptr[:-1]).max())
    xqa.stage_pages(order, indptr, last, max_pages, graph=False)
    pool = case.pool[:, 0]
    as_bf16 = xqa.run(q_in, pool, sm_scale, k_scale, v_scale, torch.empty_like(q_in))
    want = reference_decode(q_in, pool, order, indptr, last, sm_scale, k_scale, v_scale)
    err = float((as_bf16.float() - want.float()).norm() / want.float().norm())
    assert err < 5e-2
    scale = 2.0**-6
    out = torch.empty(q_in.shape, dtype=FP8_DTYPE, device="cuda")
    as_e4m3 = xqa.run(q_in, pool, sm_scale, k_scale, v_scale, out, scale)
    scale_t = torch.tensor(scale, device="cuda")
    _close_e4m3(as_e4m3, quantize_static(as_bf16, scale_t), scale_t)
