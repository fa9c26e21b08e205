"""Layer ops on CPU: the torch math is unchanged, the fused path calls flashinfer correctly, and
the selection falls back to torch when the fused ops are unavailable or fail their self-check.

The fake flashinfer implements the documented contract of the four kernels the fused ops use
(argument shapes, last-dim contiguity, int32/int64 positions, a float32 [max_pos, D] cos|sin
cache, NeoX rotation, in-place updates of fused_add_rmsnorm and RoPE) with plain float32 math,
and counts its calls. The real kernels are compared with torch on the GPU (tests/gpu).
"""

from __future__ import annotations

import logging
import sys
import threading
import types
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from runner_factories import batch, chunk, corpus_tokens, make_runner, prompt_tokens

import engine.core.runner as runner_module
import engine.modeling.layer_ops_select as select
from engine.loading.dummy_weights import dummy_model
from engine.loading.int_checkpoint import IntScheme
from engine.loading.loaders import load_model
from engine.modeling.layer_ops import (
    TORCH_OPS,
    FlashInferOps,
    LayerOpsUnavailable,
    fused_ops_unavailable_reason,
)
from engine.modeling.layer_ops_select import compare_layer_ops, create_layer_ops
from engine.modeling.llama import Attend, DecoderLayer, LlamaModel, causal_attend
from engine.quantization.int8_linear import Int8Linear


class FakeFlashInfer:
    """flashinfer.norm / .rope / .activation as strict float32 reference code."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.break_residual = False  # fused_add_rmsnorm forgets `residual += input`
        self.fail_rope = False
        self.built: list[tuple[str, str]] = []  # (JIT module, building thread)

    def _build(self, name: str) -> None:
        self.built.append((name, threading.current_thread().name))

    def get_norm_module(self) -> None:
        self._build("norm")

    def get_rope_module(self) -> None:
        self._build("rope")

    def get_act_and_mul_module(self, act: str) -> None:
        self._build(f"{act}_and_mul")

    @staticmethod
    def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)

    def rmsnorm(self, input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        self.calls["rmsnorm"] += 1
        assert input.dim() in (2, 3) and input.stride(-1) == 1
        assert weight.shape == (input.shape[-1],) and weight.dtype == input.dtype
        out = torch.empty_like(input)
        out.copy_(self._norm(input, weight, eps))
        return out

    def fused_add_rmsnorm(
        self, input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
    ) -> None:
        self.calls["fused_add_rmsnorm"] += 1
        assert input.dim() == 2 and input.shape == residual.shape
        assert input.stride(-1) == 1 and residual.stride(-1) == 1
        assert weight.shape == (input.shape[-1],) and weight.dtype == input.dtype
        assert input.data_ptr() != residual.data_ptr()
        summed = (residual.float() + input.float()).to(residual.dtype)
        if not self.break_residual:
            residual.copy_(summed)
        input.copy_(self._norm(summed, weight, eps))

    def apply_rope_with_cos_sin_cache_inplace(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        head_size: int,
        cos_sin_cache: torch.Tensor,
        is_neox: bool = True,
    ) -> None:
        self.calls["rope"] += 1
        if self.fail_rope:
            raise RuntimeError("fake kernel launch failure")
        assert is_neox
        assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.dim() == 2
        assert cos_sin_cache.is_contiguous() and cos_sin_cache.shape[1] == head_size
        assert positions.dtype in (torch.int32, torch.int64) and positions.is_contiguous()
        assert positions.shape == (query.shape[0],) == (key.shape[0],)
        for x in (query, key):
            assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % head_size == 0
            heads = x.view(x.shape[0], -1, head_size)  # what flashinfer does: must be a view
            half = head_size // 2
            cs = cos_sin_cache[positions.long()].unsqueeze(1)
            cos, sin = cs[..., :half], cs[..., half:]
            x1, x2 = heads[..., :half].float(), heads[..., half:].float()
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            heads.copy_(rotated.to(x.dtype))

    def silu_and_mul(self, input: torch.Tensor) -> torch.Tensor:
        self.calls["silu_and_mul"] += 1
        assert input.is_contiguous() and input.shape[-1] % 2 == 0
        d = input.shape[-1] // 2
        h = input.float()
        return (F.silu(h[..., :d]) * h[..., d:]).to(input.dtype)


@pytest.fixture()
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFlashInfer:
    """The fake installed as flashinfer.{norm,rope,activation}, and availability forced on."""
    impl = FakeFlashInfer()
    package = types.ModuleType("flashinfer")
    for name, fns in {
        "norm": ("rmsnorm", "fused_add_rmsnorm", "get_norm_module"),
        "rope": ("apply_rope_with_cos_sin_cache_inplace", "get_rope_module"),
        "activation": ("silu_and_mul", "get_act_and_mul_module"),
    }.items():
        module = types.ModuleType(f"flashinfer.{name}")
        for fn in fns:
            setattr(module, fn, getattr(impl, fn))
        setattr(package, name, module)
        monkeypatch.setitem(sys.modules, f"flashinfer.{name}", module)
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setattr(select, "fused_ops_unavailable_reason", lambda *a: None)
    return impl


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> LlamaModel:
    return load_model(tiny_model_dir, torch.float32)


def legacy_forward(
    m: LlamaModel, ids: torch.Tensor, positions: torch.Tensor, attend: Attend
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder written out with plain torch ops, independently of LayerOps: the
    reference the model's LayerOps path is compared with."""

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + m.cfg.rms_norm_eps)
        return w * h.to(x.dtype)

    def rot(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cfg, t = m.cfg, ids.shape[0]
    x = F.embedding(ids, m.embed_tokens)
    for i, module in enumerate(m.layers):
        layer = cast(DecoderLayer, module)
        qkv = F.linear(norm(x, layer.input_layernorm.weight), layer.qkv_proj, layer.qkv_bias)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        cos = m.rotary.cos[positions].to(q.dtype).unsqueeze(1)
        sin = m.rotary.sin[positions].to(q.dtype).unsqueeze(1)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        attn = attend(i, q, k, v).reshape(t, cfg.q_size)
        x = x + F.linear(attn, layer.o_proj, layer.o_bias)
        post = norm(x, layer.post_attention_layernorm.weight)
        gate, up = F.linear(post, layer.gate_up_proj).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, layer.down_proj)
    return x, F.linear(norm(x, m.norm.weight), m.embed_tokens if m.lm_head is None else m.lm_head)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_ops_compute_bit_for_bit_what_the_model_computed_before(
    tiny_model_dir: Path, dtype: torch.dtype
) -> None:
    m = load_model(tiny_model_dir, dtype)
    ids = torch.arange(5, 5 + 2 * 12) % m.cfg.vocab_size
    positions = torch.arange(12).repeat(2) + 3
    attend = causal_attend(2, 12, m.cfg.num_heads, m.cfg.num_kv_heads)
    with torch.no_grad():
        hidden = m(ids, positions, attend)
        logits = m.compute_logits(hidden)
        want_hidden, want_logits = legacy_forward(m, ids, positions, attend)
    assert torch.equal(hidden, want_hidden)
    assert torch.equal(logits, want_logits.float())


def test_rope_cache_holds_cos_then_sin_of_the_half_frequencies(model: LlamaModel) -> None:
    r, half = model.rotary, model.cfg.head_dim // 2
    assert r.cos_sin_cache.dtype == torch.float32 and r.cos_sin_cache.is_contiguous()
    assert r.cos_sin_cache.shape == (model.cfg.max_position_embeddings, model.cfg.head_dim)
    assert torch.equal(r.cos_sin_cache[:, :half], r.cos[:, :half])
    assert torch.equal(r.cos_sin_cache[:, half:], r.sin[:, :half])
    assert torch.equal(r.cos[:, :half], r.cos[:, half:])  # rotate-half tables repeat


def test_fused_ops_run_in_place_on_the_qkv_views_with_flashinfer_argument_shapes(
    fake: FakeFlashInfer, model: LlamaModel
) -> None:
    ops, cfg = FlashInferOps(), model.cfg
    gen = torch.Generator().manual_seed(0)
    t, eps = 5, cfg.rms_norm_eps
    w = cast(DecoderLayer, model.layers[0]).input_layernorm.weight
    x, res = torch.randn(t, cfg.hidden_size, generator=gen), torch.randn(t, cfg.hidden_size)
    want_norm, want_sum = TORCH_OPS.add_rms_norm(x.clone(), res.clone(), w, eps)
    x_ptr, res_ptr = x.data_ptr(), res.data_ptr()
    got_norm, got_sum = ops.add_rms_norm(x, res, w, eps)
    assert (got_norm.data_ptr(), got_sum.data_ptr()) == (x_ptr, res_ptr)  # in place
    torch.testing.assert_close(got_norm, want_norm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_sum, want_sum, rtol=1e-6, atol=1e-6)

    qkv = torch.randn(t, cfg.q_size + 2 * cfg.kv_size, generator=gen)
    before = qkv.clone()
    q = qkv[:, : cfg.q_size].view(t, cfg.num_heads, cfg.head_dim)
    k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(t, cfg.num_kv_heads, cfg.head_dim)
    positions = torch.tensor([0, 7, 3, 100, 2], dtype=torch.int32)
    want_q, want_k = TORCH_OPS.rope(positions, q.clone(), k.clone(), model.rotary)
    got_q, got_k = ops.rope(positions, q, k, model.rotary)
    assert got_q.data_ptr() == qkv.data_ptr()  # rotated inside qkv, no copy
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, cfg.q_size + cfg.kv_size :], before[:, cfg.q_size + cfg.kv_size :])

    h = torch.randn(t, 2 * cfg.intermediate_size, generator=gen)
    torch.testing.assert_close(ops.silu_and_mul(h), TORCH_OPS.silu_and_mul(h))
    torch.testing.assert_close(ops.rms_norm(x, w, eps), TORCH_OPS.rms_norm(x, w, eps))
    q_heads = torch.randn(t, cfg.num_heads, cfg.head_dim, generator=gen)
    norm_w = torch.rand(cfg.head_dim, generator=gen)
    torch.testing.assert_close(
        ops.rms_norm(q_heads, norm_w, eps), TORCH_OPS.rms_norm(q_heads, norm_w, eps)
    )


def test_model_with_fused_ops_launches_one_kernel_per_op_and_matches_torch(
    fake: FakeFlashInfer, model: LlamaModel
) -> None:
    ops, cfg = FlashInferOps(), model.cfg
    ids = torch.arange(3, 3 + 20) % cfg.vocab_size
    positions = torch.arange(20, dtype=torch.int32)
    attend = causal_attend(1, 20, cfg.num_heads, cfg.num_kv_heads)
    with torch.inference_mode():
        got = model.compute_logits(model(ids, positions, attend, ops), ops)
        want = model.compute_logits(model(ids, positions, attend))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    n = cfg.num_layers
    # layer 0 norms its input without a residual; the final norm is in compute_logits
    assert fake.calls == {
        "rmsnorm": 2,
        "fused_add_rmsnorm": 2 * n - 1,
        "rope": n,
        "silu_and_mul": n,
    }


def test_auto_picks_torch_on_cpu_and_an_explicit_flashinfer_request_says_why_not(
    model: LlamaModel,
) -> None:
    assert create_layer_ops("auto", model) is TORCH_OPS
    assert create_layer_ops("torch", model) is TORCH_OPS
    with pytest.raises(LayerOpsUnavailable, match="CUDA device"):
        create_layer_ops("flashinfer", model)
    with pytest.raises(ValueError, match="unknown layer ops"):
        create_layer_ops("fused", model)


def test_unavailable_reasons_name_device_dtype_head_dim_and_import(
    model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, cuda = model.cfg, torch.device("cuda", 0)
    assert "CUDA" in str(fused_ops_unavailable_reason(cfg, torch.device("cpu"), torch.bfloat16))
    assert "float32" in str(fused_ops_unavailable_reason(cfg, cuda, torch.float32))
    assert "head_dim" in str(fused_ops_unavailable_reason(cfg, cuda, torch.bfloat16))  # 32
    cfg128 = replace(cfg, head_dim=128)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails
    assert "does not import" in str(fused_ops_unavailable_reason(cfg128, cuda, torch.bfloat16))
    with pytest.raises(LayerOpsUnavailable, match="does not import"):
        FlashInferOps()


def test_auto_picks_fused_ops_that_pass_the_self_check(
    fake: FakeFlashInfer, model: LlamaModel
) -> None:
    ops = create_layer_ops("auto", model)
    assert isinstance(ops, FlashInferOps)
    # the kernels were built first, each in a worker thread, then the check ran fused layers
    assert sorted(name for name, _ in fake.built) == ["norm", "rope", "silu_and_mul"]
    assert all(thread.startswith("flashinfer-jit") for _, thread in fake.built)
    assert fake.calls["rope"] == select.SELF_CHECK_LAYERS
    assert compare_layer_ops(model, ops) < 1e-5  # float32 here: rounding only


@pytest.mark.parametrize("fault", ["wrong result", "kernel raises"])
def test_failing_self_check_falls_back_to_torch_with_a_warning_or_raises_if_explicit(
    fake: FakeFlashInfer, model: LlamaModel, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    if fault == "wrong result":
        fake.break_residual = True
    else:
        fake.fail_rope = True
    with caplog.at_level(logging.WARNING, logger="engine.modeling.layer_ops_select"):
        assert create_layer_ops("auto", model) is TORCH_OPS
    expected = "relative error" if fault == "wrong result" else "fake kernel launch failure"
    assert "failed their self-check" in caplog.text and expected in caplog.text
    with pytest.raises(LayerOpsUnavailable, match=expected):
        create_layer_ops("flashinfer", model)


def test_int8_model_gets_fused_ops_and_its_check_still_catches_a_broken_kernel(
    fake: FakeFlashInfer, model: LlamaModel
) -> None:
    """INT8 W8A8 in bf16: the check runs its projections over unquantized inputs (the
    per-token int8 rounding would turn the kernels' last-bit differences into int8 steps),
    passes at the dense tolerance, restores them, and still fails a wrong kernel."""
    int8 = dummy_model(model.cfg, torch.bfloat16, int_scheme=IntScheme(8))
    ops = create_layer_ops("auto", int8)
    assert isinstance(ops, FlashInferOps)
    assert compare_layer_ops(int8, ops) < select.SELF_CHECK_TOLERANCE
    layer = cast(DecoderLayer, int8.layers[0])
    assert layer.quantized is not None
    assert all(isinstance(p, Int8Linear) for p in layer.quantized.values())
    fake.break_residual = True
    assert create_layer_ops("auto", int8) is TORCH_OPS
    assert all(isinstance(p, Int8Linear) for p in layer.quantized.values())


def test_runner_with_fused_ops_executes_like_the_torch_runner(
    fake: FakeFlashInfer, model: LlamaModel, tiny_model_dir: Path
) -> None:
    fused, ref = make_runner(model, tiny_model_dir), make_runner(model, tiny_model_dir)
    ref = type(ref)(model, ref.kv_cache, replace(ref.config, layer_ops="torch"))
    assert fused.layer_ops.name == "flashinfer" and ref.layer_ops is TORCH_OPS
    corpus = corpus_tokens(tiny_model_dir)
    toks = [prompt_tokens(corpus, i, 40) for i in range(2)]
    blocks = [(3, 9, 1), (12, 5, 40)]
    steps = [
        batch(chunk("a", toks[0][:30], 0, blocks[0]), chunk("b", toks[1][:17], 0, blocks[1])),
        batch(chunk("a", toks[0][30:31], 30, blocks[0]), chunk("b", toks[1][17:18], 17, blocks[1])),
    ]
    before = fake.calls["rope"]
    for b in steps:
        torch.testing.assert_close(fused.execute(b), ref.execute(b), rtol=1e-4, atol=1e-4)
    assert fake.calls["rope"] - before == len(steps) * model.cfg.num_layers


class _FakeGraphs:
    """DecodeGraphs stand-in whose capture fails with fused ops (no CUDA here)."""

    built: list[str] = []

    def __init__(self, model: Any, backend: Any, max_batch: int, pages: int, ops: Any) -> None:
        self.ops = ops
        _FakeGraphs.built.append(ops.name)

    def capture(self) -> None:
        if self.ops.name != "torch":
            raise RuntimeError("operation not permitted when stream is capturing")


def test_graph_capture_failure_with_fused_ops_recaptures_with_torch_ops(
    fake: FakeFlashInfer,
    model: LlamaModel,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(runner_module, "DecodeGraphs", _FakeGraphs)
    _FakeGraphs.built = []
    runner = make_runner(model, tiny_model_dir)
    with caplog.at_level(logging.WARNING, logger="engine.core.runner"):
        graphs = runner._capture_graphs(4, 8)
    assert _FakeGraphs.built == ["flashinfer", "torch"]
    assert runner.layer_ops is TORCH_OPS and graphs.ops is TORCH_OPS
    assert "capturing with torch ops" in caplog.text
    explicit = type(runner)(model, runner.kv_cache, replace(runner.config, layer_ops="flashinfer"))
    with pytest.raises(RuntimeError, match="stream is capturing"):
        explicit._capture_graphs(4, 8)
