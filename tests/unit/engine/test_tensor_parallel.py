"""Tensor-parallel settings and their checks, without a process group: EngineConfig refuses
what TP does not support yet, an engine refuses a TP size that does not split its model
before loading it, a TP rank's KV pool holds its heads and its TP size enters the transfer
handshake, and FP8 calibration agrees on the max over the ranks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from cpu_engine import cpu_engine
from test_fp8_calibration import handshake_info, local_side

from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.kv.kv_cache import BLOCK_MAJOR, HEAD_MAJOR, KVCacheSpec
from engine.kv.kv_sizing import decide_num_host_blocks, kv_cache_spec
from engine.loading.fp8_calibration import Observed, agreed
from engine.tp.tensor_parallel import TPGroup, TPGroupError, TPGroupState
from engine.tp.tp_shard import TPShard, local_config
from kv_transfer.protocol import check_handshake
from kv_transfer.tp_plan import HeadSlice
from kv_transfer.types import compat_hash
from vocabulary.model_config import ModelConfig
from vocabulary.transfer_errors import HandshakeError


def test_engine_config_refuses_lora_and_an_explicit_host_tier_with_tp() -> None:
    EngineConfig("m", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="LoRA with tensor parallelism is not supported yet"):
        EngineConfig("m", tensor_parallel_size=2, enable_lora=True)
    with pytest.raises(ValueError, match="LoRA with tensor parallelism is not supported yet"):
        EngineConfig("m", tensor_parallel_size=2, loras=(("a", "/x"),))
    with pytest.raises(ValueError, match="host KV tier with tensor parallelism"):
        EngineConfig("m", tensor_parallel_size=2, host_kv_gb=1.0)
    with pytest.raises(ValueError, match="tensor_parallel_size: must be >= 1, got 0"):
        EngineConfig("m", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tp_timeout_s: must be > 0"):
        EngineConfig("m", tp_timeout_s=0)
    auto = EngineConfig("m", tensor_parallel_size=2)  # host_kv_gb -1 (auto): off with TP
    assert decide_num_host_blocks(auto, 1 << 20, 64) == 0


def stub_group(size: int, rank: int = 0) -> TPGroup:
    """A group that never reaches a collective (the engine refuses before)."""
    return TPGroup(TPShard(size, rank), None, None, 1.0)


def test_an_engine_refuses_a_tp_size_that_does_not_split_its_model(tiny_model_dir: Path) -> None:
    config = cpu_engine(tiny_model_dir, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="4 attention heads are not divisible by 3"):
        LLMEngine(config, tp=stub_group(3))
    with pytest.raises(ValueError, match="needs this rank's TP group"):
        LLMEngine(config)
    with pytest.raises(ValueError, match="the TP group has 2 ranks"):
        LLMEngine(config, tp=stub_group(2))


def test_a_broken_group_refuses_every_call_naming_why() -> None:
    group = stub_group(2)
    with pytest.raises(TPGroupError, match="rank 0: a peer hung"):
        raise group.fail("a peer hung")
    assert group.state is TPGroupState.BROKEN
    for call in (lambda: group.send("x"), lambda: group.agree(None), lambda: group.reduce_min(1)):
        with pytest.raises(TPGroupError, match="is broken: rank 0: a peer hung"):
            call()
    group.close()
    assert group.state is TPGroupState.CLOSED


def test_a_tp_ranks_pool_holds_its_kv_heads_and_the_handshake_plans_between_tp_sizes(
    tiny_model_dir: Path,
) -> None:
    cfg = ModelConfig.from_pretrained(tiny_model_dir)  # 2 KV heads

    def rank_spec(size: int, rank: int, layout: str = BLOCK_MAJOR) -> KVCacheSpec:
        shard = TPShard(size, rank)
        part = local_config(cfg, shard) if size > 1 else cfg
        return kv_cache_spec(part, 16, torch.float32, 8, (), shard, layout, cfg.num_kv_heads)

    one, two, four = rank_spec(1, 0), rank_spec(2, 1), rank_spec(4, 3)
    assert (one.num_kv_heads, two.num_kv_heads, four.num_kv_heads) == (2, 1, 1)
    assert two.block_nbytes * 2 == one.block_nbytes and (two.tp_size, two.tp_rank) == (2, 1)
    assert two.total_kv_heads == four.total_kv_heads == 2
    # one hash per model: the split is the handshake's KVSplit, checked against a plan
    assert compat_hash(one, "m") == compat_hash(two, "m") == compat_hash(four, "m")
    rank0 = dataclasses.replace(two, tp_rank=0)
    check_handshake(handshake_info(rank0, followers=1), *local_side(two))
    # 2 -> 4 over 2 KV heads: every decode rank reads one whole block (any layout)
    check_handshake(handshake_info(rank0, followers=1), *local_side(four))
    with pytest.raises(HandshakeError, match="one region per block only in head_major_v1"):
        check_handshake(handshake_info(rank0, followers=1), *local_side(one))
    hm_two = dataclasses.replace(rank0, layout=HEAD_MAJOR)
    hm_one = rank_spec(1, 0, HEAD_MAJOR)
    plan = check_handshake(handshake_info(hm_two, followers=1), *local_side(hm_one))
    assert plan.reads == ((HeadSlice(0, 0, 0, 1), HeadSlice(1, 0, 1, 1)),)
    with pytest.raises(ValueError, match="TP rank 2 of size 2"):
        dataclasses.replace(two, tp_rank=2)


def test_fp8_calibration_agrees_on_the_max_of_every_amax_over_the_ranks() -> None:
    """Rank 1's amaxes against rank 0's: every rank ends with the element-wise max, which is
    what a whole model observes (its heads' amax is the max over the parts)."""
    mine = Observed({"layers.0.fp8.o_proj": 1.0, "layers.0.fp8.down_proj": 5.0}, ((2.0, 3.0),))
    theirs = {"layers.0.fp8.down_proj": 4.0, "layers.0.fp8.o_proj": 7.0, "kv": (2.5, 1.0)}
    peer = [theirs["layers.0.fp8.down_proj"], theirs["layers.0.fp8.o_proj"], *theirs["kv"]]

    def agree_max(values: list[float]) -> list[float]:  # sorted names, then k0, v0
        return [max(a, b) for a, b in zip(values, peer, strict=True)]

    out = agreed(mine, agree_max)
    assert out.activations == {"layers.0.fp8.o_proj": 7.0, "layers.0.fp8.down_proj": 5.0}
    assert out.kv == ((2.5, 3.0),)


class LateWork:
    """A pending collective whose first wait times out and which completes right after (as
    gloo's does when the peer's message lands between the timeout and the check), with
    `error` raised by every later wait (None: it succeeded)."""

    def __init__(self, error: str | None) -> None:
        self.error = error
        self.waits = 0

    def wait(self, timeout: object = None) -> bool:
        self.waits += 1
        if self.waits == 1 or self.error is not None:
            raise RuntimeError("Operation timed out!" if self.waits == 1 else self.error)
        return True

    def is_completed(self) -> bool:
        return self.waits >= 1


def test_an_op_completing_just_after_an_idle_wait_timed_out_is_received() -> None:
    group = TPGroup(TPShard(2, 1), None, None, timeout_s=1.0)
    what = "waiting for rank 0's next step"
    late = LateWork(None)
    assert group._wait(late, what, 0.5, idle=True)  # type: ignore[arg-type]
    assert group.state is TPGroupState.OPEN and late.waits == 2
    failed = LateWork("Connection closed by peer")
    with pytest.raises(TPGroupError, match="waiting for rank 0's next step: Connection closed"):
        group._wait(failed, what, 0.5, idle=True)  # type: ignore[arg-type]
    assert group.state is TPGroupState.BROKEN
