"""Prefill and decode actors on a real local Ray, NIXL over UCX and Redis give exactly the
tokens transformers gives (greedy, float32), in 1P1D, 2P2D and colocated serving; a decode
worker that already caches a prompt's prefix pulls only the blocks it lacks."""

from __future__ import annotations

import asyncio

import pytest
import ray
from pd_client import Served, greedy, load, serve, wait_idle
from references import Reference
from workers_harness import Workers

from vocabulary.engine_io import FinishReason

pytestmark = pytest.mark.timeout(180)

MAX_TOKENS = 24


def check_against_transformers(
    served: list[Served], prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    for i, (s, prompt) in enumerate(zip(served, prompts, strict=True)):
        expected = hf_greedy_to_eos(prompt, MAX_TOKENS)
        assert s.token_ids == expected, f"request {i} ({len(prompt)} prompt tokens)"
        final = s.chunks[-1] if s.chunks else s.prefill
        assert final is not None and final.finish_reason is not None
        if len(expected) < MAX_TOKENS:
            assert final.finish_reason is FinishReason.STOP, f"request {i} ended on eos"
        else:
            assert final.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


async def serve_all(pairs: list[tuple[object, object]], prompts: list[list[int]], tag: str):
    return await asyncio.gather(
        *(
            serve(p, d, f"{tag}-{i}", prompt, greedy(MAX_TOKENS))
            for i, ((p, d), prompt) in enumerate(zip(pairs, prompts, strict=True))
        )
    )


def test_1p1d_32_concurrent_greedy_requests_match_transformers(
    workers: Workers, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    stats_before = ray.get(workers.d0.transfer_stats.remote(), timeout=30)
    pairs = [(workers.p0, workers.d0)] * len(corpus_prompts)
    served = asyncio.run(serve_all(pairs, corpus_prompts, "1p1d"))
    check_against_transformers(served, corpus_prompts, hf_greedy_to_eos)
    assert any(len(s.token_ids) < MAX_TOKENS for s in served), "no request ended on eos"
    stats = ray.get(workers.d0.transfer_stats.remote(), timeout=30)
    pulled = sum(1 for s in served if s.chunks)
    assert stats.transfers_done - stats_before.transfers_done == pulled
    assert stats.transfers_failed == stats_before.transfers_failed
    wait_idle(workers.p0, workers.d0)


def test_2p2d_32_concurrent_greedy_requests_match_transformers(
    workers: Workers, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    prefills, decodes = (workers.p0, workers.p1), (workers.d0, workers.d1)
    before = {w: load(w).requests_done for w in (*prefills, *decodes)}
    # Request i: prefill on p[i % 2], decode on d[(i // 2) % 2]: every pairing serves 8.
    pairs = [(prefills[i % 2], decodes[(i // 2) % 2]) for i in range(len(corpus_prompts))]
    served = asyncio.run(serve_all(pairs, corpus_prompts, "2p2d"))
    check_against_transformers(served, corpus_prompts, hf_greedy_to_eos)
    assert {(s.prefill.worker_id if s.prefill else None) for s in served} == {"p0", "p1"}
    for w in (*prefills, *decodes):
        assert load(w).requests_done - before[w] >= 8
    wait_idle(*prefills, *decodes)


def test_colocated_decode_worker_prefills_locally_and_matches_transformers(
    workers: Workers, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    pairs = [(None, workers.d1)] * len(corpus_prompts)
    served = asyncio.run(serve_all(pairs, corpus_prompts, "colocated"))
    check_against_transformers(served, corpus_prompts, hf_greedy_to_eos)
    for s, prompt in zip(served, corpus_prompts, strict=True):
        first = s.chunks[0]
        assert first.num_transferred_tokens == 0 and first.transfer_s == 0.0
        assert first.num_prompt_tokens == len(prompt)
    wait_idle(workers.d1)


def test_decode_worker_pulls_only_the_blocks_it_does_not_cache(
    workers: Workers, tokenizer, hf_greedy_to_eos: Reference
) -> None:
    salt = "shared-prefix-test"  # hashes no other test's blocks share
    text = (
        "Once upon a time there was a fox who wanted to learn to read. He found a book in "
        "the grass and carried it to the owl. The owl taught him the letters, one each night"
    )
    ids = tokenizer.encode(text)
    assert len(ids) >= 50
    a = ids[:50]  # 3 full blocks + 2 tokens
    other = "A small lighthouse stands at the end of the harbour wall. Its keeper is a quiet woman"
    tail = tokenizer.encode(other)[1:21]  # 20 tokens, without the leading bos
    b = ids[:48] + tail  # shares a's 3 full blocks; 68 tokens = 5 blocks
    assert len(b) == 68

    def stats():
        return ray.get(workers.d0.transfer_stats.remote(), timeout=30)

    s0 = stats()
    first = asyncio.run(serve(workers.p0, workers.d0, "prefix-a", a, greedy(8), salt))
    s1 = stats()
    assert (s1.blocks_transferred - s0.blocks_transferred, s1.blocks_reused - s0.blocks_reused) == (
        4,
        0,
    )
    assert first.chunks[0].num_transferred_tokens == 50

    # Prefilled on the other prefill worker (no cache there): decode still reuses its blocks.
    second = asyncio.run(serve(workers.p1, workers.d0, "prefix-b", b, greedy(8), salt))
    s2 = stats()
    num_blocks_b = -(-len(b) // 16)
    assert second.prefill is not None and second.prefill.num_cached_prompt_tokens == 0
    assert (s2.blocks_transferred - s1.blocks_transferred, s2.blocks_reused - s1.blocks_reused) == (
        num_blocks_b - 3,
        3,
    )
    assert second.chunks[0].num_transferred_tokens == len(b) - 48
    assert second.token_ids == hf_greedy_to_eos(b, 8)
    wait_idle(workers.p0, workers.p1, workers.d0)
