"""Megatron sharding (engine/tp/tp_shard.py): every rank's part of every tensor, cut from the
checkpoint as it streams, from dummy weights or from an FP8 checkpoint, puts the whole model
back together; the KV heads are replicated when the TP size exceeds them; a TP size that does
not split the model is refused naming the count that does not divide."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from deploy.cli.app import app
from engine.loading.dummy_weights import dummy_model
from engine.loading.hf_checkpoint import hf_state_dict
from engine.loading.loaders import load_model
from engine.tp.tp_shard import (
    TPShard,
    check_tp_size,
    kv_head_range,
    local_config,
    q_head_range,
    shard_fused,
    shard_tensor,
)
from vocabulary.model_config import ModelConfig, RopeConfig

# 8 query heads, 2 KV heads, q/k/v and o biases (Llama with attention_bias)
CFG = ModelConfig(
    model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
    num_heads=8, num_kv_heads=2, head_dim=4, max_position_embeddings=128, rms_norm_eps=1e-6,
    rope=RopeConfig(), tie_word_embeddings=False, attention_bias=True, o_proj_bias=True,
    qk_norm=False, bos_token_id=None, eos_token_ids=(), torch_dtype="float32",
)  # fmt: skip


def random_full(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of `cfg`, random (biases too)."""
    gen = torch.Generator().manual_seed(0)
    names = hf_state_dict(dummy_model(cfg, torch.float32))
    return {n: torch.randn(t.shape, generator=gen) for n, t in names.items()}


@pytest.mark.parametrize("size", [2, 4, 8])
def test_shards_of_every_checkpoint_tensor_concatenate_back_to_it(size: int) -> None:
    """q/gate/up rows and o/down columns concatenate back; k/v rows too, or (size 8 > 2 KV
    heads) each rank holds its query heads' KV head whole; the o bias sums back (rank 0 holds
    it); norms, embeddings and head are whole on every rank."""
    full = random_full(CFG)
    shards = [TPShard(size, r) for r in range(size)]
    for name, tensor in full.items():
        parts = [shard_tensor(name, tensor, CFG, s) for s in shards]
        if "k_proj" in name or "v_proj" in name:
            if size <= CFG.num_kv_heads:
                assert torch.equal(torch.cat(parts), tensor), name
            else:
                d = CFG.head_dim
                for s, part in zip(shards, parts, strict=True):
                    head = s.rank * CFG.num_kv_heads // size
                    assert torch.equal(part, tensor[head * d : (head + 1) * d]), name
        elif name.endswith(("q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight")):
            assert torch.equal(torch.cat(parts), tensor), name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), tensor), name
        elif name.endswith("o_proj.bias"):
            assert torch.equal(parts[0], tensor) and not any(p.any() for p in parts[1:])
        else:
            assert all(p is tensor for p in parts), name


def test_replicated_kv_heads_are_those_each_ranks_query_heads_read() -> None:
    group = CFG.num_heads // CFG.num_kv_heads
    for size in (2, 4, 8):
        for rank in range(size):
            shard = TPShard(size, rank)
            kv = kv_head_range(CFG, shard)
            assert {h // group for h in q_head_range(CFG, shard)} <= set(kv)
    assert [kv_head_range(CFG, TPShard(8, r)).start for r in range(8)] == [0] * 4 + [1] * 4
    local = local_config(CFG, TPShard(8, 5))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (1, 1, 6)


def test_dummy_weights_of_a_shard_are_that_part_of_the_whole_dummy_model() -> None:
    whole = dummy_model(CFG, torch.float32, seed=3)
    for rank in range(4):
        shard = TPShard(4, rank)
        part = dummy_model(CFG, torch.float32, seed=3, shard=shard)
        assert part.tp_shard == shard and part.cfg == local_config(CFG, shard)
        for name, tensor in hf_state_dict(part).items():
            want = shard_tensor(name, hf_state_dict(whole)[name], CFG, shard)
            assert torch.equal(tensor, want), name
        layer = whole.layers[1]
        assert torch.equal(
            part.layers[1].qkv_proj, shard_fused("qkv_proj", layer.qkv_proj, CFG, shard)
        )


@pytest.mark.parametrize("size", [2, 4])
def test_a_shard_loaded_from_the_checkpoint_reads_only_its_part(
    tiny_model_dir: Path, size: int
) -> None:
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    whole = hf_state_dict(load_model(tiny_model_dir, torch.float32))
    for rank in range(size):
        shard = TPShard(size, rank)
        part = load_model(tiny_model_dir, torch.float32, shard=shard)
        assert part.tp_shard == shard
        for name, tensor in hf_state_dict(part).items():
            assert torch.equal(tensor, shard_tensor(name, whole[name], cfg, shard)), name
    assert load_model(tiny_model_dir, torch.float32, shard=TPShard(1, 0)).tp_shard is None


def test_an_fp8_checkpoints_shard_dequantizes_to_the_dense_shard(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Per-channel weight scales follow their rows and are kept per row: within the
    checkpoint's one e4m3 rounding of the dense weights, as for the whole model."""
    out = tmp_path / "fp8"
    made = CliRunner().invoke(
        app, ["make-model", str(out), "--quantization", "fp8", "--from", str(tiny_model_dir)]
    )
    assert made.exit_code == 0, made.output
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    dense = load_model(tiny_model_dir, torch.float32)
    shard = TPShard(2, 1)
    part = load_model(out, torch.float32, shard=shard)
    assert part.quantization == "fp8"
    for ours, ref in zip(part.layers, dense.layers, strict=True):
        assert ours.quantized is not None
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            linear = ours.quantized[name]
            want = shard_fused(name, getattr(ref, name), cfg, shard)
            got = linear.dequantized(torch.float32)
            assert linear.per_channel and linear.weight_scale.shape == (want.shape[0],)
            rows = linear.weight_scale.reshape(-1, 1)
            bound = want.abs() * 2.0**-4 * 1.01 + rows * 2**-10
            assert bool(((got - want).abs() <= bound).all()), name


def test_a_tp_size_that_does_not_split_the_model_is_refused_naming_the_count() -> None:
    check_tp_size(CFG, 8)
    with pytest.raises(ValueError, match="8 attention heads are not divisible by 3"):
        check_tp_size(CFG, 3)
    with pytest.raises(ValueError, match="8 KV heads neither divide by 3 nor divide it"):
        check_tp_size(replace(CFG, num_heads=12, num_kv_heads=8), 3)
    with pytest.raises(ValueError, match="intermediate_size 50 is not divisible by 4"):
        check_tp_size(replace(CFG, intermediate_size=50), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not split llama"):
        local_config(CFG, TPShard(3, 0))
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        TPShard(2, 2)
