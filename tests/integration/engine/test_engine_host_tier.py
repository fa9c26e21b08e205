"""The host KV tier on a real engine (CPU: both tiers are host memory, the logic is the same):
evicted prefix blocks land there, a later request onboards them and gets the transformers
tokens, the host LRU reports what it drops, and every path gives every block and slot back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_factories import greedy, make_engine, run_to_completion, tokens_of
from references import Reference

from engine.config import EngineMode
from engine.core.engine import LLMEngine
from engine.modeling.llama import LlamaModel
from kv_transfer.budget import Candidate, InFlightBudget
from kv_transfer.config import BudgetConfig
from vocabulary.block_hash import BlockHash, hash_chain, hash_extra
from vocabulary.engine_io import KVHandoff, RequestOutput
from vocabulary.kv_events import KVEvent, KVEventKind, KVTier
from vocabulary.tokenizer import Tokenizer

DEVICE_BLOCKS = 8  # 128 tokens: every new prompt evicts the one before it


def host_gb(engine_blocks: int, tiny_model_dir: Path, model: LlamaModel, tok: Tokenizer) -> float:
    """host_kv_gb that gives `engine_blocks` host blocks for the tiny model."""
    probe = make_engine(tiny_model_dir, model, tok, num_kv_blocks=1, host_kv_gb=0)
    return engine_blocks * probe.kv_cache.spec.block_nbytes / 2**30


@pytest.fixture()
def make(tiny_model_dir: Path, tiny_model: LlamaModel, tokenizer: Tokenizer):  # type: ignore[no-untyped-def]
    def make_tiered(host_blocks: int, **overrides: object) -> LLMEngine:
        gb = host_gb(host_blocks, tiny_model_dir, tiny_model, tokenizer) if host_blocks else 0
        return make_engine(
            tiny_model_dir, tiny_model, tokenizer,
            num_kv_blocks=DEVICE_BLOCKS, host_kv_gb=gb, **overrides,
        )  # fmt: skip

    return make_tiered


def run(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int = 10) -> list[int]:
    engine.add_request(rid, prompt, greedy(max_tokens))
    tokens = tokens_of(run_to_completion(engine)[rid])
    engine.release_request_blocks(rid)  # (a prefill-only engine keeps them for a hand-off)
    return tokens


def chain_of(engine: LLMEngine, prompt: list[int]) -> list[BlockHash]:
    return hash_chain(prompt, 16, hash_extra(engine.model_id, ""))


def replay(events: list[KVEvent]) -> dict[BlockHash, KVTier]:
    """The tier of every hash the worker holds, as the index sees it from the events."""
    held: dict[BlockHash, KVTier] = {}
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


@pytest.mark.parametrize(
    "split",
    [{}, {"mode": EngineMode.SPLIT, "split_decode_headroom_blocks": 1}],
    ids=["colocated", "split"],
)
def test_an_evicted_prefix_is_onboarded_from_the_host_tier_token_exact(
    make, prompts: list[list[int]], hf_greedy: Reference, split: dict[str, object]
) -> None:
    """(A split engine onboards in its prefill lane's schedule, on the lane's stream.)"""
    engine = make(host_blocks=64, **split)
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
    assert held == {h: KVTier.DEVICE for h in snap.device_hashes} | {
        h: KVTier.HOST for h in snap.host_hashes
    }
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
    assert held == {h: KVTier.DEVICE for h in snap.device_hashes} | {
        h: KVTier.HOST for h in snap.host_hashes
    }
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


FILLERS = [[(i * 37 + j * 11) % 250 + 3 for j in range(33)] for i in range(12)]
"""Distinct 33-token prompts (2 full blocks each) that cycle the device pool."""


def evicted_to_host(engine: LLMEngine, prompt: list[int]) -> None:
    """Run `prompt`, then cycle the 8-block device pool so its prefix lives in the host tier."""
    run(engine, "warm", prompt)
    for i, other in enumerate(FILLERS):
        run(engine, f"cycle{i}", other)
        if None in engine.block_pool.match_prefix_tiers(chain_of(engine, prompt)):
            return
    raise AssertionError("the prompt's blocks are still on the device")


def test_an_onboard_the_budget_holds_back_waits_in_the_queue_while_the_step_goes_on(
    make, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    engine = make(host_blocks=64)
    budget = InFlightBudget(BudgetConfig(64, 1 << 30, 64, 1 << 30))
    engine.use_copy_budget(budget)
    evicted_to_host(engine, prompts[2])
    pulls = Candidate("pull", "prefill-peer", 64, 1 << 20)
    budget.acquire(pulls)  # the worker's KV pulls hold the budget
    engine.add_request("running", prompts[5], greedy(12))
    engine.step()
    engine.add_request("back", prompts[2], greedy(10))
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(4):  # the step goes on for the running request; "back" waits
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert [r.request_id for r in engine.scheduler.waiting] == ["back"]
    assert len(tokens_of(outs["running"])) >= 3
    tier = engine.load().host_tier
    assert tier is not None and tier.onboard.queued_blocks > 0 and tier.onboard.deferred == 1
    budget.release(pulls)
    for rid, more in run_to_completion(engine).items():
        outs.setdefault(rid, []).extend(more)
    assert tokens_of(outs["back"]) == hf_greedy(prompts[2], 10)
    assert outs["back"][-1].num_cached_prompt_tokens == 48  # onboarded, not recomputed
    assert tokens_of(outs["running"]) == hf_greedy(prompts[5], 12)
    engine.step()  # the next decision gives the last moves' budget back
    assert (budget.num_blocks, budget.num_transfers) == (0, 0)
    assert_idle(engine)


def test_a_transfer_reservation_pulls_the_blocks_the_budget_cannot_onboard(
    make, prompts: list[list[int]]
) -> None:
    engine = make(host_blocks=64, mode=EngineMode.DECODE_ONLY)
    budget = InFlightBudget(BudgetConfig(8, 1 << 30, 8, 1 << 30))
    engine.use_copy_budget(budget)
    evicted_to_host(engine, prompts[2])
    budget.acquire(Candidate("pull", "prefill-peer", 8, 1 << 20))
    chain = chain_of(engine, prompts[2])
    hits = engine.block_pool.match_prefix_tiers(chain)
    alloc = engine.allocate_for_transfer("pulled", prompts[2], chain)
    assert alloc.num_cached_blocks == hits.index(None)  # the host-tier part is pulled instead
    assert engine.host_tier is not None and engine.host_tier.stats().onboard.queued_blocks == 0
    assert engine.free_transfer_blocks("pulled")
    assert_idle(engine)


def prefill_handoff(engine: LLMEngine, rid: str, prompt: list[int]) -> KVHandoff:
    engine.add_request(rid, prompt, greedy(5))
    [out] = [o for o in run_to_completion(engine)[rid] if o.kv_handoff is not None]
    assert out.kv_handoff is not None
    return out.kv_handoff


def test_a_handoff_lends_its_host_tier_copies_and_gives_the_device_blocks_back(
    make, prompts: list[list[int]], tiny_model_dir: Path, tiny_model: LlamaModel,
    tokenizer: Tokenizer,
) -> None:  # fmt: skip
    engine = make(host_blocks=64, mode=EngineMode.PREFILL_ONLY)
    evicted_to_host(engine, prompts[2])
    handoff = prefill_handoff(engine, "h", prompts[2])  # 58 tokens: 3 full blocks + 1
    tiers = handoff.block_tiers
    assert len(tiers) == 4 and tiers[-1] is KVTier.DEVICE and KVTier.HOST in tiers
    lent = [b for b, t in zip(handoff.block_ids, tiers, strict=True) if t is KVTier.HOST]
    assert engine.load().num_handoff_blocks == tiers.count(KVTier.DEVICE)
    tier = engine.host_tier
    assert tier is not None and tier.stats().num_pinned == tier.num_lent == len(lent)
    # the host copies hold the prompt's KV: as a fresh engine without a tier computes it
    plain = make_engine(tiny_model_dir, tiny_model, tokenizer, host_kv_gb=0,
                        mode=EngineMode.PREFILL_ONLY, num_kv_blocks=DEVICE_BLOCKS)  # fmt: skip
    fresh = prefill_handoff(plain, "h", prompts[2])
    for i, (block, t) in enumerate(zip(handoff.block_ids, tiers, strict=True)):
        if t is KVTier.HOST:
            assert torch.equal(tier.tensor[block], plain.kv_cache.tensor[fresh.block_ids[i]])
    # while lent, the host LRU never reuses the slots, however much passes through it
    kept = tier.tensor[lent].clone()
    for i, other in enumerate(prompts * 2):
        prefill_handoff(engine, f"o{i}", other)
        engine.release_request_blocks(f"o{i}")
    assert torch.equal(tier.tensor[lent], kept)
    assert engine.release_request_blocks("h")
    assert tier.stats().num_pinned == 0
    assert_idle(engine)


def test_an_aborted_or_reset_handoff_gives_its_host_slots_back(
    make, prompts: list[list[int]]
) -> None:
    engine = make(host_blocks=64, mode=EngineMode.PREFILL_ONLY)
    evicted_to_host(engine, prompts[2])
    assert KVTier.HOST in prefill_handoff(engine, "a", prompts[2]).block_tiers
    assert engine.abort_request("a")  # (a lease that expired takes the same path)
    assert_idle(engine)
    assert KVTier.HOST in prefill_handoff(engine, "b", prompts[2]).block_tiers
    engine.reset_prefix_cache()  # the lent slots keep their data until given back
    assert engine.release_request_blocks("b")
    assert engine.host_tier is not None and engine.host_tier.num_cached == 0
    assert_idle(engine)


def test_with_handoff_from_host_off_every_block_is_handed_off_from_the_device(
    make, prompts: list[list[int]]
) -> None:
    engine = make(host_blocks=64, mode=EngineMode.PREFILL_ONLY, host_kv_handoff=False)
    evicted_to_host(engine, prompts[2])
    handoff = prefill_handoff(engine, "h", prompts[2])
    assert handoff.block_tiers == ()
    assert engine.load().num_handoff_blocks == len(handoff.block_ids)
    assert engine.release_request_blocks("h")
    assert_idle(engine)
