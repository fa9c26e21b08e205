"""A hand-made performance profile for the simulator's tests (`make_profile`): prefill 10 ms +
1 ms per token, decode 10 ms a step whatever the batch, hand-off 5 ms."""

from __future__ import annotations

from planner.perf_profile import (
    DecodePoint,
    HandoffCost,
    PerfProfile,
    PrefillPoint,
    ProfileHeader,
)


def make_profile(max_num_batched_tokens: int = 2048) -> PerfProfile:
    header = ProfileHeader(
        model_id="synthetic", num_layers=1, hidden_size=8, num_kv_heads=1, head_dim=8,
        vocab_size=500, dtype="float32", tensor_parallel_size=1, device="cpu", block_size=16,
        num_kv_blocks=1024, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=64,
        pdserve_version="test", torch_version="none",
    )  # fmt: skip
    return PerfProfile(
        header,
        prefill=(PrefillPoint(1, 0.011), PrefillPoint(100, 0.11), PrefillPoint(200, 0.21)),
        decode=(DecodePoint(1, 100, 0.01), DecodePoint(8, 100, 0.01)),
        handoff=HandoffCost(0.005),
    )
