"""Performance profiles for the simulator's tests: a hand-made one (`make_profile`: prefill
10 ms + 1 ms per token, decode 10 ms a step whatever the batch, hand-off 5 ms) and the tiny
model's on CPU (`tiny_cpu_profile`)."""

from __future__ import annotations

from dataclasses import replace

from planner.perf_profile import (
    DecodePoint,
    HandoffCost,
    PerfProfile,
    PrefillPoint,
    ProfileHeader,
    ServingOverhead,
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


def tiny_cpu_profile() -> PerfProfile:
    """The tiny model on one CPU core (`pdserve profile`, rounded), with the serving overheads
    measured on the 2-core machine ("Simulator" in docs/benchmarks.md, run B)."""
    header = ProfileHeader(
        model_id="tiny", num_layers=4, hidden_size=128, num_kv_heads=2, head_dim=32,
        vocab_size=512, dtype="float32", tensor_parallel_size=1, device="cpu", block_size=16,
        num_kv_blocks=1024, max_num_batched_tokens=2048, max_num_seqs=256,
        pdserve_version="test", torch_version="none",
    )  # fmt: skip
    prefill_ms = {16: 3.0, 64: 3.7, 128: 5.6, 256: 12.5, 512: 34.2, 1024: 111.8, 2048: 664.5}
    decode_ms = {  # context -> {batch: ms}
        64: {1: 1.5, 4: 2.0, 16: 3.7, 32: 5.9},
        256: {1: 1.9, 4: 2.9, 16: 6.5, 32: 8.6},
        1024: {1: 3.1, 4: 5.0, 16: 8.3, 32: 8.8},
    }
    return PerfProfile(
        header,
        prefill=(
            *(PrefillPoint(n, ms / 1000) for n, ms in prefill_ms.items()),
            PrefillPoint(128, 0.0105, cached_tokens=512),
        ),
        decode=tuple(
            DecodePoint(b, c, ms / 1000) for c, row in decode_ms.items() for b, ms in row.items()
        ),
        handoff=HandoffCost(0.012),
        serving=ServingOverhead(request_s=0.0099, prefill_factor=1.41, decode_step_s=0.0016),
    )


def scaled_profile(
    profile: PerfProfile, tp: int, step_factor: float, **header: object
) -> PerfProfile:
    """`profile` as if measured at TP `tp`: every prefill and decode step `step_factor` times
    as long, header fields replaced by `header` (a TP size's profile made by hand)."""
    return replace(
        profile,
        header=replace(profile.header, tensor_parallel_size=tp, **header),  # type: ignore[arg-type]
        prefill=tuple(replace(p, step_s=p.step_s * step_factor) for p in profile.prefill),
        decode=tuple(replace(p, step_s=p.step_s * step_factor) for p in profile.decode),
    )
