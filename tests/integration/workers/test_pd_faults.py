"""A decode actor killed mid-stream ends its callers' streams with Ray's actor error at once
(never a hang); the prefill worker that lent it KV returns to its idle baseline and keeps
serving other decode workers."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from pd_client import (
    consume,
    decode_request,
    greedy,
    next_chunk,
    open_stream,
    prefill,
    serve,
    wait_idle,
)
from references import Reference
from workers_harness import Workers

pytestmark = pytest.mark.timeout(120)

ENDLESS = greedy(3000, ignore_eos=True)
ERROR_WITHIN_S = 30.0


def test_killing_a_decode_actor_mid_stream_ends_its_streams_with_an_actor_error(
    workers: Workers, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    p, victim = workers.p0, workers.victim
    prompts = corpus_prompts[24:30]

    async def run() -> float:
        results = await asyncio.gather(
            *(prefill(p, f"kill-pd-{i}", x, ENDLESS) for i, x in enumerate(prompts[:4]))
        )
        gens = [
            open_stream(victim, decode_request(r.request_id, x, ENDLESS, r))
            for r, x in zip(results, prompts[:4], strict=True)
        ]
        gens += [
            open_stream(victim, decode_request(f"kill-local-{i}", x, ENDLESS))
            for i, x in enumerate(prompts[4:])
        ]
        for g in gens:
            for _ in range(2):
                chunk = await next_chunk(g)
                assert chunk is not None and chunk.finish_reason is None
        ray.kill(victim, no_restart=True)
        t0 = time.monotonic()
        for g in gens:
            with pytest.raises(ray.exceptions.RayActorError):
                await consume(g, ERROR_WITHIN_S)  # TimeoutError here would be the hang
        with pytest.raises(ray.exceptions.RayActorError):
            await asyncio.wait_for(victim.load.remote(), ERROR_WITHIN_S)
        return time.monotonic() - t0

    elapsed = asyncio.run(run())
    assert elapsed < ERROR_WITHIN_S
    # The hand-offs had completed before the kill, so no lease waits for expiry.
    wait_idle(p)
    survivor = asyncio.run(serve(p, workers.d0, "kill-after", prompts[0], greedy(24)))
    assert survivor.token_ids == hf_greedy_to_eos(prompts[0], 24)
    wait_idle(p, workers.d0)


def test_a_hand_off_from_a_prefill_worker_that_is_gone_fails_as_a_transfer_error(
    workers: Workers, corpus_prompts: list[list[int]]
) -> None:
    """The handle names a prefill worker no actor answers for any more (it died after its
    hand-off): the decode worker's handshake fails with PeerLost, a TransferError the router
    retries elsewhere, and nothing stays held."""
    from dataclasses import replace

    from vocabulary.transfer_errors import PeerLost, TransferError

    p, d = workers.p1, workers.d1
    prompt = corpus_prompts[30]

    async def run() -> None:
        result = await prefill(p, "gone-peer", prompt, greedy(4))
        assert result.handle is not None
        gone = replace(result.handle, worker_id="prefill-gone", agent_name="agent-of-the-gone")
        ghost = replace(result, handle=gone)
        gen = open_stream(d, decode_request("gone-peer", prompt, greedy(4), ghost))
        with pytest.raises(TransferError) as failed:
            await consume(gen)
        assert isinstance(failed.value, PeerLost) and "prefill-gone" in str(failed.value)
        await asyncio.wait_for(p.abort.remote("gone-peer"), 30)  # its lease, released now

    asyncio.run(run())
    wait_idle(p, d)
