"""Static FP8 scales (engine/loading/fp8_calibration.py), the FP8 ops' torch composition, the e4m3
KV pool's spec and its place in the transfer handshake; a pipeline's calibration pass through
its stages observes what a whole model's does."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.kv.kv_cache import FP8_KV_DTYPE, KVCache, KVCacheSpec
from engine.loading.fp8_calibration import (
    ACTIVATION_HEADROOM,
    KV_HEADROOM,
    calibrate_activations,
    calibration_ids,
    kv_scales,
    observe,
    prepare_fp8,
)
from engine.loading.loaders import load_model
from engine.modeling.layer_ops import TORCH_OPS
from engine.modeling.llama import LlamaModel
from engine.quantization.fp8_linear import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Linear,
    pow2_scale,
    quantize_static,
)
from kv_transfer.backend import MemoryRegion
from kv_transfer.protocol import PROTOCOL_VERSION, HandshakeInfo, RankAgent, check_handshake
from kv_transfer.tp_plan import KVSplit
from kv_transfer.types import compat_fields, compat_hash, kv_split
from vocabulary.transfer_errors import HandshakeError


@pytest.fixture()
def tiny_model(tiny_model_dir: Path) -> Callable[[], LlamaModel]:
    """A fresh float32 copy of the tiny trained model per call (the tests quantize it)."""
    return lambda: load_model(tiny_model_dir, torch.float32)


def test_pow2_scale_is_the_smallest_power_of_two_covering_the_headroom() -> None:
    assert pow2_scale(448.0, 1.0) == 1.0
    assert pow2_scale(449.0, 1.0) == 2.0
    assert pow2_scale(1.0, 4.0) == 2.0**-6  # 4/448 = 0.0089 -> 2^-6 = 0.0156
    assert pow2_scale(0.0, 4.0) > 0
    s = pow2_scale(3.7, 2.0)
    assert s >= 3.7 * 2 / FP8_MAX > s / 2 and math.log2(s).is_integer()


def test_quantize_static_saturates_and_rounds_to_e4m3() -> None:
    x = torch.tensor([0.0, 1.0, -3.0, 1000.0, -1000.0, 0.3])
    q = quantize_static(x, torch.tensor(0.5))
    assert q.dtype == FP8_DTYPE
    assert q.float().tolist()[:5] == [0.0, 2.0, -6.0, FP8_MAX, -FP8_MAX]
    assert abs(float(q.float()[5]) - 0.6) <= 0.6 * 2**-4


def test_observe_records_every_fp8_input_and_every_layers_kv(
    tiny_model: Callable[[], LlamaModel],
) -> None:
    model = tiny_model()
    model.quantize_fp8()
    ids = list(range(3, 40))
    seen = observe(model, ids)
    names = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert set(seen.activations) == names and len(names) == 4 * model.cfg.num_layers
    assert all(a > 0 for a in seen.activations.values())
    assert len(seen.kv) == model.cfg.num_layers and all(k > 0 and v > 0 for k, v in seen.kv)
    assert observe(model, ids) == seen  # deterministic: equal models calibrate equally


def test_calibration_sets_static_scales_only_where_the_checkpoint_gave_none(
    tiny_model: Callable[[], LlamaModel],
) -> None:
    model = tiny_model()
    model.quantize_fp8()
    seen = observe(model, list(range(3, 40)))
    kept = model.layers[0].quantized["down_proj"]  # type: ignore[index]
    kept.input_scale = torch.tensor(0.125)
    assert calibrate_activations(model, seen) == 4 * model.cfg.num_layers - 1
    assert float(kept.input_scale) == 0.125
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear) and m is not kept:
            assert m.is_static
            assert float(m.input_scale) >= seen.activations[name] * ACTIVATION_HEADROOM / FP8_MAX
    scales = kv_scales(seen)
    assert len(scales) == 2 * model.cfg.num_layers
    assert scales[1] >= seen.kv[0][1] * KV_HEADROOM / FP8_MAX


def test_static_scales_keep_the_layer_close_to_dynamic_quantization(
    tiny_model: Callable[[], LlamaModel],
) -> None:
    model = tiny_model()
    model.quantize_fp8()
    ids = list(range(3, 40))
    x = torch.nn.functional.embedding(torch.tensor(ids), model.embed_tokens)
    from engine.modeling.llama import causal_attend

    attend = causal_attend(1, len(ids), model.cfg.num_heads, model.cfg.num_kv_heads)
    pos = torch.arange(len(ids))
    layer = model.layers[0]
    dynamic = layer(0, x.clone(), None, pos, model.rotary, attend, TORCH_OPS)[0]
    calibrate_activations(model, observe(model, ids))
    static = layer(0, x.clone(), None, pos, model.rotary, attend, TORCH_OPS)[0]
    err = float((static - dynamic).norm() / dynamic.norm())
    assert 0 < err < 0.1  # both e4m3, scales up to 4x apart: a few e4m3 steps at most


def test_an_e4m3_input_needs_the_static_scale() -> None:
    lin = Fp8Linear.from_weight(torch.randn(16, 16))
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="static input_scale"):
        lin(quantize_static(x, 0.01), out_dtype=torch.float32)
    lin.input_scale = torch.tensor(2.0**-6)
    assert torch.equal(lin(x), lin(quantize_static(x, lin.input_scale), out_dtype=torch.float32))


def test_prepare_fp8_refuses_unknown_settings_and_leaves_a_plain_model_alone(
    tiny_model: Callable[[], LlamaModel],
) -> None:
    model = tiny_model()

    def encode(text: str) -> list[int]:
        return [3 + ord(c) % 60 for c in text]

    def never_called(text: str) -> list[int]:
        raise AssertionError("calibrated a model that needs no FP8 scales")

    with pytest.raises(ValueError, match="quantization"):
        prepare_fp8(model, encode, "int4", "auto", 64)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        prepare_fp8(model, encode, "none", "fp4", 64)
    untouched = prepare_fp8(model, never_called, "none", "auto", 64)  # nothing to calibrate
    assert untouched == () and model.quantization == "none"
    assert len(prepare_fp8(model, encode, "none", "fp8", 64)) == 2 * model.cfg.num_layers
    assert model.quantization == "none"  # an FP8 pool does not quantize the weights


def test_calibration_ids_keep_to_the_vocabulary_and_the_limit() -> None:
    ids = calibration_ids(lambda text: [ord(c) for c in text], 128, 50)
    assert len(ids) == 50 and max(ids) < 128
    with pytest.raises(ValueError, match="no token"):
        calibration_ids(lambda text: [1000], 128, 50)


SPEC = KVCacheSpec(num_blocks=4, num_layers=2, block_size=4, num_kv_heads=1, head_dim=8,
                   dtype="float32")  # fmt: skip


def test_an_e4m3_spec_needs_one_scale_per_layer_for_k_and_v() -> None:
    fp8 = dataclasses.replace(SPEC, dtype=FP8_KV_DTYPE, scales=(1.0, 2.0, 4.0, 8.0))
    assert fp8.block_nbytes * 4 == SPEC.block_nbytes and fp8.layer_scales(1) == (4.0, 8.0)
    assert SPEC.layer_scales(0) == (1.0, 1.0)
    with pytest.raises(ValueError, match="needs 4 scales"):
        dataclasses.replace(SPEC, dtype=FP8_KV_DTYPE)
    with pytest.raises(ValueError, match="needs 0 scales"):
        dataclasses.replace(SPEC, scales=(1.0,) * 4)
    assert KVCache(fp8).tensor.dtype == FP8_DTYPE


def handshake_info(spec: KVCacheSpec, followers: int = 0) -> HandshakeInfo:
    """A prefill worker's handshake over pools of `spec` (`followers`: ranks beyond 0)."""
    region = MemoryRegion("DRAM", 0, spec.nbytes, spec.block_nbytes, spec.num_blocks)
    return HandshakeInfo(
        protocol_version=PROTOCOL_VERSION,
        compat_hash=compat_hash(spec, "m"),
        compat_fields=compat_fields(spec, "m"),
        worker_id="p0",
        agent_name="P",
        agent_metadata=b"",
        region=region,
        split=kv_split(spec),
        followers=tuple(RankAgent(f"P{r}", b"", region) for r in range(1, followers + 1)),
    )


def local_side(spec: KVCacheSpec) -> tuple[str, str, KVSplit, int, int]:
    """What `check_handshake` takes of the local pool."""
    fields = compat_fields(spec, "m")
    return compat_hash(spec, "m"), fields, kv_split(spec), spec.head_nbytes, spec.num_segments


def test_the_handshake_refuses_a_peer_whose_kv_dtype_or_scales_differ() -> None:
    fp8 = dataclasses.replace(SPEC, dtype=FP8_KV_DTYPE, scales=(1.0, 2.0, 4.0, 8.0))
    other_scales = dataclasses.replace(fp8, scales=(1.0, 2.0, 4.0, 16.0))
    check_handshake(handshake_info(fp8), *local_side(fp8))
    with pytest.raises(HandshakeError, match="dtype: peer float8_e4m3fn vs local float32"):
        check_handshake(handshake_info(fp8), *local_side(SPEC))
    with pytest.raises(HandshakeError, match="kv_scales: peer"):
        check_handshake(handshake_info(other_scales), *local_side(fp8))


class _Relay:
    """Two pipeline stages in one process: what stage 0 sends, stage 1 receives."""

    def __init__(self, first: bool) -> None:
        self.first = first
        self.sent: torch.Tensor | None = None
        self.inbox: torch.Tensor | None = None

    def receive_activations(
        self, num_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        if self.first:
            return None
        assert self.inbox is not None and self.inbox.shape == (2, num_tokens, hidden)
        return self.inbox

    def send_activations(self, pair: torch.Tensor) -> None:
        self.sent = pair


def test_a_pipelines_calibration_pass_observes_each_stage_as_the_whole_model(
    tiny_model_dir: Path,
) -> None:
    from engine.pp.pp_stage import PPStage

    ids = list(range(1, 40))
    whole = load_model(tiny_model_dir, torch.float32, quantization="fp8")
    want = observe(whole, ids)
    first, second = _Relay(True), _Relay(False)
    stages = [PPStage.of(4, 2, s) for s in (0, 1)]
    models = [
        load_model(tiny_model_dir, torch.float32, quantization="fp8", stage=s) for s in stages
    ]
    got0 = observe(models[0], ids, first)
    second.inbox = first.sent
    got1 = observe(models[1], ids, second)
    assert got0.kv + got1.kv == want.kv  # exactly: the stages compute the whole pass
    renamed = {f"layers.{int(n.split('.')[1]) + 2}.{n.split('.', 2)[2]}": v
               for n, v in got1.activations.items()}  # fmt: skip
    assert {**got0.activations, **renamed} == want.activations
