"""The host KV tier on a real engine (CPU: both tiers are host memory, the logic is the same):
evicted prefix blocks land there, a later request onboards them and gets the transformers
tokens, the host LRU reports what it drops, and every path gives every block and slot back."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Reference
from engine_factories import greedy, make_engine, run_to_completion, tokens_of

from engine.block_hash import BlockHash, hash_chain, hash_extra
from engine.config import EngineMode
from engine.engine import LLMEngine
from engine.kv_events import KVEvent, KVEventKind
from engine.model import LlamaModel
from engine.tokenizer import Tokenizer

DEVICE_BLOCKS = 8  # 128 tokens: every new prompt evicts the one before it


def host_gb(engine_blocks: int, tiny_model_dir: Path, model: LlamaModel, tok: Tokenizer) -> float:
    """host_kv_gb that gives `engine_blocks` host blocks for the tiny model."""
    probe = make_engine(tiny_model_dir, model, tok, num_kv_blocks=1, host_kv_gb=0)
    return engine_blocks * probe.kv_cache.spec.block_nbytes / 2**30


@pytest.fixture()
def make(tiny_model_dir: Path, tiny_model: LlamaModel, tiny_tokenizer: Tokenizer):  # type: ignore[no-untyped-def]
    def make_tiered(host_blocks: int, **overrides: object) -> LLMEngine:
        gb = host_gb(host_blocks, tiny_model_dir, tiny_model, tiny_tokenizer) if host_blocks else 0
        return make_engine(
            tiny_model_dir, tiny_model, tiny_tokenizer,
            num_kv_blocks=DEVICE_BLOCKS, host_kv_gb=gb, **overrides,
        )  # fmt: skip

    return make_tiered


def run(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int = 10) -> list[int]:
    engine.add_request(rid, prompt, greedy(max_tokens))
    return tokens_of(run_to_completion(engine)[rid])


def chain_of(engine: LLMEngine, prompt: list[int]) -> list[BlockHash]:
    return hash_chain(prompt, 16, hash_extra(engine.model_id, ""))


def replay(events: list[KVEvent]) -> dict[BlockHash, str]:
    """The tier of every hash the worker holds, as the index sees it from the events."""
    held: dict[BlockHash, str] = {}
    for e in events:
        if e.kind is KVEventKind.CLEARED:
            held.clear()
        for h in e.block_hashes:
            if e.tier is None:
                held.pop(h, None)
            else:
                held[h] = e.tier
    return held


def assert_idle(engine: LLMEngine) -> None:
    pool, tier = engine.block_pool, engine.host_tier
    assert pool.num_free == pool.num_blocks
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))
    assert tier is not None and not any(tier._pins)


def test_an_evicted_prefix_is_onboarded_from_the_host_tier_token_exact(
    make, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    engine = make(host_blocks=64)
    first = prompts[2]  # 58 tokens: 3 full blocks
    assert run(engine, "a", first) == hf_greedy(first, 10)
    for i, other in enumerate((prompts[3], prompts[4], prompts[7], prompts[0])):
        run(engine, f"cycle{i}", other)  # cycles the 8-block device pool
    hits = engine.block_pool.match_prefix_tiers(chain_of(engine, first))
    assert len(hits) == 3 and None in hits  # held, partly in the host tier only
    events = engine.take_kv_events()
    assert any(e.kind is KVEventKind.OFFLOADED for e in events)

    engine.add_request("again", first, greedy(10))
    outs = run_to_completion(engine)["again"]
    assert tokens_of(outs) == hf_greedy(first, 10)
    assert outs[-1].num_cached_prompt_tokens == 48  # all 3 full blocks, none recomputed
    load = engine.load()
    assert load.num_host_hit_tokens > 0 and load.host_tier is not None
    assert load.host_tier.num_onboarded == load.num_host_hit_tokens // 16
    assert load.host_tier.num_offloaded > 0
    # the onboarded blocks are device-cached again: STORED (device tier) for them
    held = replay(events + engine.take_kv_events())
    snap = engine.cache_snapshot()
    assert held == {h: "device" for h in snap.device_hashes} | {h: "host" for h in snap.host_hashes}
    assert_idle(engine)


def test_a_full_host_tier_drops_lru_blocks_and_reports_them_removed(
    make, prompts: list[list[int]]
) -> None:
    engine = make(host_blocks=4)
    events: list[KVEvent] = []
    for i, prompt in enumerate(prompts * 2):
        run(engine, f"r{i}", prompt)
        events += engine.take_kv_events()
    tier = engine.host_tier
    assert tier is not None and tier.num_evicted > 0 and tier.num_cached == 4
    assert any(e.kind is KVEventKind.REMOVED for e in events)
    snap = engine.cache_snapshot()
    assert len(snap.host_hashes) <= 4
    held = replay(events)  # what the index rebuilt from the events equals a fresh snapshot
    assert held == {h: "device" for h in snap.device_hashes} | {h: "host" for h in snap.host_hashes}
    assert_idle(engine)


def test_onboard_then_cancel_or_preemption_loses_nothing_and_leaks_nothing(
    make, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    engine = make(host_blocks=64)
    run(engine, "warm", prompts[2])
    for i, other in enumerate((prompts[3], prompts[4], prompts[7], prompts[0])):
        run(engine, f"cycle{i}", other)
    # cancelled right after its onboard was queued (admitted, not yet computed)
    engine.add_request("cancelled", prompts[2], greedy(10))
    engine.scheduler.schedule()  # admits it: onboards its prefix into device blocks
    assert engine.host_tier is not None and engine.host_tier.num_onboarded > 0
    assert engine.abort_request("cancelled")
    assert_idle(engine)
    # several onboarding requests in a pool too small for all: preemption, recompute
    for i in range(3):
        engine.add_request(f"p{i}", prompts[i], greedy(20))
    outs = run_to_completion(engine)
    for i in range(3):
        assert tokens_of(outs[f"p{i}"]) == hf_greedy(prompts[i], 20)
    assert_idle(engine)


def test_the_decode_side_reuses_host_tier_blocks_for_a_transfer(
    make, prompts: list[list[int]]
) -> None:
    engine = make(host_blocks=64, mode=EngineMode.DECODE_ONLY)
    prompt = prompts[2]
    run(engine, "local", prompt)  # a decode worker prefills short prompts itself
    for i, other in enumerate((prompts[3], prompts[4], prompts[7], prompts[0])):
        run(engine, f"cycle{i}", other)
    chain = chain_of(engine, prompt)
    hits = engine.block_pool.match_prefix_tiers(chain)
    assert None in hits  # at least part of it lives only in the host tier now
    alloc = engine.allocate_for_transfer("pulled", prompt, chain)
    assert alloc.num_cached_blocks == len(chain)  # nothing of the full blocks to transfer
    assert engine.free_transfer_blocks("pulled")
    assert_idle(engine)
