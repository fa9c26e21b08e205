"""Prefill-only → decode-only hand-off inside one process (blocks copied with
KVCache.copy_blocks_from), and every terminal path returning the pools to their baseline."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_factories import greedy, make_engine, run_to_completion, tokens_of
from references import Reference

from engine.config import EngineMode
from engine.core.engine import LLMEngine
from engine.kv.block_pool import NoFreeBlocksError
from engine.modeling.llama import LlamaModel
from vocabulary.block_hash import hash_chain, hash_extra
from vocabulary.engine_io import FinishReason, KVHandoff, RequestOutput
from vocabulary.sampling import SamplingParams
from vocabulary.tokenizer import Tokenizer


@pytest.fixture()
def pair(
    tiny_model_dir: Path, tiny_model: LlamaModel, tokenizer: Tokenizer
) -> tuple[LLMEngine, LLMEngine]:
    """A prefill-only engine and a decode-only engine sharing the loaded model."""
    args = (tiny_model_dir, tiny_model, tokenizer)
    return (
        make_engine(*args, mode=EngineMode.PREFILL_ONLY, num_kv_blocks=64),
        make_engine(*args, mode=EngineMode.DECODE_ONLY, num_kv_blocks=48),
    )


def prefill(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams):  # type: ignore[no-untyped-def]
    engine.add_request(request_id, prompt, params)
    [out] = run_to_completion(engine)[request_id]
    return out


def hand_off(
    prefill_engine: LLMEngine,
    decode_engine: LLMEngine,
    out: RequestOutput,
    prompt: list[int],
    params: SamplingParams,
) -> int:
    """Move a finished prefill's KV to the decode engine and start decoding it there;
    returns how many leading blocks the decode side already had cached."""
    handoff = out.kv_handoff
    assert isinstance(handoff, KVHandoff)
    alloc = decode_engine.allocate_for_transfer(out.request_id, prompt, handoff.block_hashes)
    n = alloc.num_cached_blocks
    decode_engine.kv_cache.copy_blocks_from(
        prefill_engine.kv_cache, list(handoff.block_ids[n:]), list(alloc.blocks_to_transfer)
    )
    assert prefill_engine.release_request_blocks(out.request_id)
    decode_engine.add_transferred_request(out.request_id, handoff.first_token_id, params)
    return n


def test_prefill_only_then_decode_only_gives_the_transformers_tokens(
    pair: tuple[LLMEngine, LLMEngine], prompts: list[list[int]], hf_greedy: Reference
) -> None:
    p, d = pair
    params = greedy(10)
    cached: dict[str, int] = {}
    for i in (0, 2, 3, 5):  # 2 extends 0: its first two blocks are cached on d by then
        rid = f"r{i}"
        out = prefill(p, rid, prompts[i], params)
        assert out.finish_reason is FinishReason.HANDOFF and out.new_token_ids == (
            hf_greedy(prompts[i], 10)[0],
        )
        handoff = out.kv_handoff
        assert handoff is not None
        assert handoff.num_tokens == len(prompts[i])
        assert len(handoff.block_ids) == -(-len(prompts[i]) // 16)
        assert len(handoff.block_hashes) == len(prompts[i]) // 16
        assert p.load().num_handoff_blocks == len(handoff.block_ids)
        cached[rid] = hand_off(p, d, out, prompts[i], params)
        decoded = run_to_completion(d)[rid]
        assert [handoff.first_token_id, *tokens_of(decoded)] == hf_greedy(prompts[i], 10)
        assert decoded[-1].finish_reason is FinishReason.LENGTH
    assert cached == {"r0": 0, "r2": 2, "r3": 0, "r5": 0}
    assert p.block_pool.num_free == p.block_pool.num_blocks
    assert d.block_pool.num_free == d.block_pool.num_blocks


def test_held_handoff_blocks_are_never_evicted(
    tiny_model_dir: Path,
    tiny_model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
) -> None:
    p = make_engine(
        tiny_model_dir, tiny_model, tokenizer, mode=EngineMode.PREFILL_ONLY, num_kv_blocks=8
    )
    out = prefill(p, "held", prompts[2], greedy(10))
    assert out.kv_handoff is not None
    held = out.kv_handoff.block_ids
    assert len(held) == 4
    # Other prompts cycle through the 4 remaining blocks, evicting each other's cache entries.
    for k in (3, 4, 5, 6, 7, 1):
        prefill(p, f"x{k}", prompts[k], greedy(10))
        assert p.release_request_blocks(f"x{k}")
    assert p.block_pool.num_evicted > 0
    assert [p.block_pool.ref_count(b) for b in held] == [1, 1, 1, 1]
    assert p.block_pool.match_prefix(out.kv_handoff.block_hashes) == list(held[:3])
    assert p.release_request_blocks("held") and not p.release_request_blocks("held")
    assert p.block_pool.num_free == 8


def test_first_token_that_ends_the_request_is_not_handed_off(
    pair: tuple[LLMEngine, LLMEngine], prompts: list[list[int]]
) -> None:
    p, _ = pair
    out = prefill(p, "one", prompts[0], greedy(1))
    assert out.finish_reason is FinishReason.LENGTH and out.kv_handoff is None
    assert p.block_pool.num_free == p.block_pool.num_blocks


def test_failed_transfer_frees_the_decode_blocks(
    pair: tuple[LLMEngine, LLMEngine], prompts: list[list[int]]
) -> None:
    p, d = pair
    out = prefill(p, "r", prompts[2], greedy(10))
    assert out.kv_handoff is not None
    alloc = d.allocate_for_transfer("r", prompts[2], out.kv_handoff.block_hashes)
    assert alloc.block_ids == (0, 1, 2, 3) and alloc.num_cached_blocks == 0
    assert d.load().num_transfer_blocks == 4
    assert d.free_transfer_blocks("r") and not d.free_transfer_blocks("r")
    assert d.block_pool.num_free == d.block_pool.num_blocks


def test_transfer_larger_than_the_free_pool_is_refused(
    tiny_model_dir: Path,
    tiny_model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
) -> None:
    d = make_engine(tiny_model_dir, tiny_model, tokenizer, num_kv_blocks=5)
    long_chain = hash_chain(prompts[2], 16, hash_extra(d.model_id))
    other_chain = hash_chain(prompts[4], 16, hash_extra(d.model_id))
    d.allocate_for_transfer("a", prompts[2], long_chain)  # 4 of the 5 blocks
    with pytest.raises(NoFreeBlocksError):  # needs 3
        d.allocate_for_transfer("b", prompts[4], other_chain)
    assert d.load().num_transfer_blocks == 4 and d.block_pool.num_free == 1


def test_abort_anywhere_returns_every_pool_to_baseline(
    pair: tuple[LLMEngine, LLMEngine],
    tiny_model_dir: Path,
    tiny_model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
) -> None:
    p, d = pair
    # Prefill side: one held hand-off and one request mid-prefill.
    held = prefill(p, "held", prompts[0], greedy(10))
    assert held.kv_handoff is not None
    # Decode side: one reserved transfer and one decoding request.
    d.allocate_for_transfer("reserved", prompts[0], held.kv_handoff.block_hashes)
    colocated = make_engine(
        tiny_model_dir, tiny_model, tokenizer, block_size=4, max_num_batched_tokens=8
    )
    for i, prompt in enumerate(prompts):
        colocated.add_request(f"c{i}", prompt, greedy(10))
    for _ in range(6):  # some decoding, some mid-prefill, some waiting
        colocated.step()
    states = {r.status.value for r in colocated.scheduler.requests.values()}
    assert {"running", "waiting"} <= states
    assert p.abort_request("held") and d.abort_request("reserved")
    assert all(colocated.abort_request(f"c{i}") for i in range(len(prompts)))
    assert not colocated.abort_request("c0")
    for engine in (p, d, colocated):
        assert engine.block_pool.num_free == engine.block_pool.num_blocks
        assert not engine.has_unfinished()
        load = engine.load()
        assert (load.num_handoff_blocks, load.num_transfer_blocks) == (0, 0)
    assert colocated.step() == []
