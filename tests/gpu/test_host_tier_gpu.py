"""The host KV tier on the GPU path it exists for: pinned host slots, offloads on a side stream,
the fence a step waits on when it overwrites a block whose copy is still in flight, onboards
on the step's stream, with overlap scheduling and CUDA-graph decode on.

Blocks come back bit-exact whichever path copied them out (side stream, or at eviction on the
step's stream), and an engine whose device pool cycles gives the tokens of one that never
evicts (greedy, bf16), with the returning prompt's full blocks onboarded, not recomputed.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, EngineMode
from engine.core.engine import LLMEngine
from engine.kv.host_tier import HostTier
from engine.loading.loaders import load_model
from engine.modeling.llama import LlamaModel
from vocabulary.block_hash import BlockHash
from vocabulary.sampling import SamplingParams
from vocabulary.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def block_hash(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


@pytest.mark.parametrize("block_dim", [0, 1], ids=["block_major", "layer_major"])
def test_blocks_come_back_bit_exact_from_either_offload_path(block_dim: int) -> None:
    """(A layer-major pool, [layers, blocks, ...], is copied one layer's run at a time.)"""
    shape = [64, 2, 2, 16, 2, 64]
    shape[0], shape[block_dim] = shape[block_dim], shape[0]
    pool = torch.randn(shape, device="cuda").to(torch.bfloat16)
    device_kv = pool.movedim(block_dim, 0)  # a [blocks, ...] view, for the checks
    original = device_kv.clone()
    tier = HostTier(32, pool, max_blocks_per_step=8, block_dim=block_dim)
    assert tier.tensor.is_pinned() and tier.tensor.shape[block_dim] == 32
    for b in range(16):
        tier.offer(b, block_hash(b))
    tier.flush()  # blocks 0-7 on the side stream; 8-15 wait for the next flush
    assert tier.on_device_evict(3, block_hash(3))  # copied, maybe still in flight: a fence
    assert tier.on_device_evict(12, block_hash(12))  # never copied: copied now, step stream
    tier.fence()
    device_kv[:16].zero_()  # the next step overwrites the evicted blocks
    slots = [tier.lookup(block_hash(b)) for b in (3, 12)]
    assert None not in slots
    tier.onboard([(slots[0], 40), (slots[1], 41)])  # type: ignore[list-item]
    torch.cuda.synchronize()
    assert torch.equal(device_kv[40], original[3]) and torch.equal(device_kv[41], original[12])
    assert tier.stats().num_offloaded == 9  # 8 flushed + 1 at eviction


@pytest.mark.parametrize("block_dim", [0, 1], ids=["block_major", "layer_major"])
def test_a_flush_queues_its_copies_without_waiting_for_the_running_step(block_dim: int) -> None:
    """The engine flushes just before it launches a step, while the previous one may still
    run: queueing the offload (the gather, its index through pinned memory, the copies to
    pinned memory) must not wait for the device. With a ~200 ms kernel on the step stream the
    flush returns long before it ends, and the blocks arrive once it has."""
    shape = [256, 32, 2, 16, 8, 128]  # Llama-3-8B-shaped blocks (2 MiB)
    shape[0], shape[block_dim] = shape[block_dim], shape[0]
    pool = torch.randn(shape, device="cuda").to(torch.bfloat16)
    blocks = pool.movedim(block_dim, 0)
    tier = HostTier(128, pool, max_blocks_per_step=128, block_dim=block_dim)
    g = torch.Generator().manual_seed(block_dim)
    for round_ in range(2):  # the first flush builds what it needs; the second is timed
        offered = torch.randperm(256, generator=g)[:128].tolist()
        for b in offered:
            tier.offer(b, block_hash(1000 * round_ + b))
        if round_ == 0:
            tier.flush()
            torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~200 ms of cycles on the step stream
    t0 = time.perf_counter()
    tier.flush()
    queued_s = time.perf_counter() - t0
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_running and queued_s < 0.05, f"the flush took {queued_s * 1e3:.1f} ms"
    host = tier.tensor.movedim(block_dim, 0)
    for b in offered:
        slot = tier.lookup(block_hash(1000 + b))
        assert slot is not None and torch.equal(host[slot], blocks[b].cpu())


def test_a_mover_used_from_a_second_stream_waits_for_its_last_move() -> None:
    """A split engine's two loops share the step mover's staging buffer from two streams:
    a move on the second stream waits (on the device) for the first's, whose copies may
    still use the buffer, and both land bit-exact."""
    from engine.kv.block_mover import BlockMover

    pool = torch.randn([64, 4, 2, 16, 2, 64], device="cuda").to(torch.bfloat16)
    host = torch.zeros([32, 4, 2, 16, 2, 64], dtype=torch.bfloat16).pin_memory()
    host[16:] = torch.randn([16, 4, 2, 16, 2, 64]).to(torch.bfloat16)
    mover = BlockMover(pool, host, 0, staging_blocks=8)
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(first):
        torch.cuda._sleep(400_000_000)  # ~200 ms before the first move
        mover.to_host([(b, b) for b in range(8)])
    with torch.cuda.stream(second):
        mover.to_device([(16 + i, 40 + i) for i in range(8)])
        done = torch.cuda.Event()
        done.record()
    time.sleep(0.02)
    waited = not done.query()
    torch.cuda.synchronize()
    assert waited, "the second stream's move did not wait for the first's"
    assert torch.equal(host[:8], pool[:8].cpu())
    assert torch.equal(pool[40:48].cpu(), host[16:24])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from deploy.checkpoints.make_model import make_model

    out = tmp_path_factory.mktemp("tiny-bf16-host-tier") / "model"
    return make_model(out, preset="tiny", num_layers=2, torch_dtype="bfloat16", hidden_size=256)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> LlamaModel:
    return load_model(model_dir, torch.bfloat16, "cuda")


def engine_with(model_dir: Path, model: LlamaModel, **overrides: object) -> LLMEngine:
    config = EngineConfig(
        model_dir=str(model_dir), device="cuda", dtype="bfloat16", attention_backend="flashinfer",
        max_num_seqs=8, cuda_graph_max_batch=8, max_model_len=1024,
    )  # fmt: skip
    return LLMEngine(replace(config, **overrides), model, Tokenizer.from_model_dir(model_dir))


def run(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    engine.add_request(rid, prompt, GREEDY)
    tokens: list[int] = []
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                cached = out.num_cached_prompt_tokens
    return tokens, cached


@pytest.mark.parametrize("mode", [EngineMode.COLOCATED, EngineMode.SPLIT])
def test_a_cycled_device_pool_onboards_and_gives_the_tokens_of_one_that_never_evicts(
    model_dir: Path, model: LlamaModel, mode: EngineMode
) -> None:
    """A split engine's onboards run on its prefill stream, in order with the prefill step
    that reads them (engine/core/prefill_lane.py)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 500, (100,), generator=g).tolist() for _ in range(6)]
    # the roomy engine's second round hits its device prefix cache: the same computation
    # (a cached 96-token prefix, 4 prompt tokens computed) as an onboarded prefix
    roomy = engine_with(model_dir, model, num_kv_blocks=256, host_kv_gb=0)
    expected = [[run(roomy, f"r{rnd}-{i}", p) for i, p in enumerate(prompts)] for rnd in (0, 1)]
    assert [cached for _, cached in expected[1]] == [96] * 6
    split = {} if mode is EngineMode.COLOCATED else {"split_decode_sms": 32}  # (one stream)
    blocks = 24 if split else 16  # (the split's decode headroom)
    small = engine_with(model_dir, model, num_kv_blocks=blocks, host_kv_gb=0.01, mode=mode, **split)
    tier = small.host_tier
    assert tier is not None and tier.tensor.is_pinned()
    onboard_streams: list[torch.cuda.Stream] = []
    onboard = tier.onboard

    def onboard_on_stream(pairs: list[tuple[int, int]]) -> None:
        onboard_streams.append(torch.cuda.current_stream())
        onboard(pairs)

    tier.onboard = onboard_on_stream  # type: ignore[method-assign]
    for rnd in range(2):  # the second round finds every prompt evicted from the device
        for i, prompt in enumerate(prompts):
            assert run(small, f"s{rnd}-{i}", prompt) == expected[rnd][i]
    load = small.load()
    assert load.host_tier is not None and load.host_tier.num_onboarded >= 6 * 6
    assert small.block_pool.num_free == small.block_pool.num_blocks
    lane = small.prefill_lane
    if lane is not None:
        with lane.streams.prefill():
            prefill_stream = torch.cuda.current_stream()
        assert onboard_streams and set(onboard_streams) == {prefill_stream}


@pytest.mark.parametrize("layout", ["block_major_v1", "layer_major_v1"])
def test_a_decode_pool_on_the_gpu_reads_hand_off_blocks_from_pinned_host_memory(
    layout: str,
) -> None:
    """NIXL (UCX) from a prefill agent's registered host tier (pinned DRAM) and its VRAM pool
    into a decode agent's VRAM pool, two agents of one process: one read per region, bytes
    exact; prints the host-region read rate (compare with the pinned copy, bench_host_tier).
    Layer-major: the host tier has the pool's layout, and a read is a descriptor per layer."""
    import queue
    import time as clock

    from engine.kv.kv_cache import KVCache, KVCacheSpec
    from kv_transfer.config import KVTransferConfig
    from kv_transfer.decode_endpoint import DecodeEndpoint
    from kv_transfer.manager import TransferOutcome, TransferState
    from kv_transfer.prefill_endpoint import PrefillEndpoint
    from vocabulary.kv_events import KVTier

    # Llama-3-8B block shape (2 MiB a block), 512 blocks a side
    spec = KVCacheSpec(num_blocks=512, num_layers=32, block_size=16, num_kv_heads=8,
                       head_dim=128, dtype="bfloat16", layout=layout)  # fmt: skip
    pool = KVCache(spec, "cuda")
    pool.tensor.normal_()
    host = torch.randn(spec.shape, dtype=torch.bfloat16).pin_memory()  # 512 blocks too
    config = KVTransferConfig(idle_tick_s=0.01)
    released: queue.Queue[str] = queue.Queue()
    prefill = PrefillEndpoint(pool, "m", "p0", lambda rid, _: released.put(rid), config,
                              tiers={KVTier.HOST: host})  # fmt: skip
    decode_pool = KVCache(spec, "cuda")
    outcomes: queue.Queue[TransferOutcome] = queue.Queue()
    decode = DecodeEndpoint(decode_pool, "m", "d0", outcomes.put, outcomes.put, config)
    try:
        info = prefill.start()
        decode.start()
        decode.add_peer(info)
        n = 256  # 512 MiB from host memory, then 16 blocks from the pool
        ids = list(range(n)) + list(range(16))
        tiers = [KVTier.HOST] * n + [KVTier.DEVICE] * 16
        handle = prefill.hand_off("r", ids, [b"%015d!" % i for i in range(n + 15)],
                                  (n + 16) * 16, block_tiers=tiers)  # fmt: skip
        t0 = clock.perf_counter()
        decode.submit(handle, list(range(n + 16)))
        outcome = outcomes.get(timeout=60)
        seconds = clock.perf_counter() - t0
        assert outcome.state is TransferState.DONE, outcome.error
        got = decode_pool.tensor.movedim(spec.block_dim, 0)  # [blocks, ...] in either layout
        assert torch.equal(got[:n].cpu(), host.movedim(spec.block_dim, 0)[:n])
        assert torch.equal(got[n : n + 16], pool.tensor.movedim(spec.block_dim, 0)[:16])
        assert released.get(timeout=10) == "r"
        print(f"{layout}: host tier -> remote VRAM over NIXL: "
              f"{outcome.plan.nbytes / seconds / 1e9:.1f} GB/s "
              f"({outcome.plan.nbytes >> 20} MiB in {seconds * 1000:.1f} ms, "
              f"{outcome.plan.num_descriptors} descriptors)")  # fmt: skip
    finally:
        decode.close()
        prefill.close()
