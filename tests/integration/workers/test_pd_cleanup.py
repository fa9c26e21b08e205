"""Every way a request can end early frees everything it held: streams cancelled mid-decode
and mid-transfer, `abort(request_id)` on both roles (queued, running, leased, transferring,
waiting for KV blocks), and a graceful drain that finishes in-flight work while refusing new
requests. "Freed" means the pools are back at the idle baseline: every block allocatable
(evictable prefix-cache entries count as free in this BlockPool), no lease, no transfer."""

from __future__ import annotations

import asyncio
import random

import pytest
import ray
from channel_client import ChannelReader
from pd_client import (
    NUM_KV_BLOCKS,
    consume,
    decode_request,
    greedy,
    load,
    next_chunk,
    open_stream,
    prefill,
    serve,
    wait_idle,
    wait_idle_async,
    wait_until,
)
from references import Reference
from workers_harness import Workers

from vocabulary.decode_api import TokenChunk
from vocabulary.engine_io import FinishReason
from vocabulary.worker_api import RequestAborted, WorkerDraining, WorkerLoad, WorkerState

pytestmark = pytest.mark.timeout(180)

ENDLESS = greedy(3000, ignore_eos=True)  # runs until cancelled
SHORT_WAIT_S = 20.0  # an early end must reach the caller well within this
LEASE_NOTICE_S = 5.0  # a lease ended by a notice ends well within this (lease_s is 30 s)


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(n)]


def end_leases(p, *request_ids: str) -> None:  # type: ignore[no-untyped-def]
    """Cleanup after a failed test: no lease of it outlives it (later tests count blocks)."""
    ray.get([p.abort.remote(rid) for rid in request_ids], timeout=30)


def submitted(n: int):  # type: ignore[no-untyped-def]
    def check(w: WorkerLoad) -> bool:
        return w.transfer.in_flight_transfers + w.transfer.queued_transfers == n

    return check


async def expect_cancelled(gen) -> None:  # type: ignore[no-untyped-def]
    """The stream ends with Ray's cancellation error (chunks already made may come first)."""
    with pytest.raises((ray.exceptions.TaskCancelledError, asyncio.CancelledError)):
        await consume(gen, SHORT_WAIT_S)


async def expect_aborted(gen) -> list[TokenChunk]:  # type: ignore[no-untyped-def]
    """The stream ends cleanly with a final chunk whose finish reason is ABORT."""
    chunks = await consume(gen, SHORT_WAIT_S)
    assert chunks and chunks[-1].finish_reason is FinishReason.ABORT
    assert all(c.finish_reason is None for c in chunks[:-1])
    return chunks


def test_cancelling_streams_mid_decode_frees_every_block(
    workers: Workers, corpus_prompts: list[list[int]]
) -> None:
    p, d = workers.p0, workers.d0

    async def run() -> None:
        prompts = corpus_prompts[:6]
        results = await asyncio.gather(
            *(prefill(p, f"cancel-pd-{i}", x, ENDLESS) for i, x in enumerate(prompts[:4]))
        )
        gens = [
            open_stream(d, decode_request(r.request_id, x, ENDLESS, r))
            for r, x in zip(results, prompts, strict=False)
        ]
        gens += [  # local prefill (conditional disaggregation / colocated)
            open_stream(d, decode_request(f"cancel-local-{i}", x, ENDLESS))
            for i, x in enumerate(prompts[4:])
        ]
        for g in gens:
            for _ in range(2):
                chunk = await next_chunk(g)
                assert chunk is not None and chunk.finish_reason is None
        assert load(d).inflight_requests == 6
        for g in gens:
            ray.cancel(g)
        for g in gens:
            await expect_cancelled(g)

    asyncio.run(run())
    wait_idle(p, d)


def test_abort_ends_decode_streams_with_finish_reason_abort_and_frees_every_block(
    workers: Workers, corpus_prompts: list[list[int]]
) -> None:
    p, d = workers.p1, workers.d0

    async def run() -> None:
        prompts = corpus_prompts[8:12]
        results = await asyncio.gather(
            *(prefill(p, f"abort-pd-{i}", x, ENDLESS) for i, x in enumerate(prompts[:2]))
        )
        requests = [
            decode_request(r.request_id, x, ENDLESS, r)
            for r, x in zip(results, prompts[:2], strict=True)
        ]
        requests += [
            decode_request(f"abort-local-{i}", x, ENDLESS) for i, x in enumerate(prompts[2:])
        ]
        gens = [open_stream(d, req) for req in requests]
        for g in gens:
            assert (await next_chunk(g)) is not None
        found = await asyncio.gather(*(d.abort.remote(req.request_id) for req in requests))
        assert found == [True] * 4
        for g in gens:
            await expect_aborted(g)
        assert await d.abort.remote("abort-pd-0") is False  # nothing held any more

    asyncio.run(run())
    wait_idle(p, d)


def test_cancel_and_abort_mid_transfer_free_every_block(
    workers: Workers, tokenizer, hf_greedy_to_eos: Reference
) -> None:
    """Reads that have not completed (held by the test gate) and transfers queued behind
    them (4-block budget) are cancelled or aborted; the one left alone completes."""
    p, d = workers.p0, workers.gated
    salt = "mid-transfer"
    prompts = [random_prompt(40, seed) for seed in range(3)]  # 3 blocks each
    prompts.append(tokenizer.encode("The baker opens his shop before the sun is up. He lights"))
    failed_before = ray.get(d.transfer_stats.remote(), timeout=30).transfers_failed
    ray.get(d.close_gate.remote(), timeout=30)
    try:

        async def run() -> None:
            sp = [ENDLESS, ENDLESS, ENDLESS, greedy(12)]
            results = await asyncio.gather(
                *(
                    prefill(p, f"mid-transfer-{i}", x, s, salt)
                    for i, (x, s) in enumerate(zip(prompts, sp, strict=True))
                )
            )
            gens = []
            for r, x, s in zip(results, prompts, sp, strict=True):
                gens.append(open_stream(d, decode_request(r.request_id, x, s, r, salt)))
                # one at a time, so the first submitted is the one in flight
                await asyncio.to_thread(
                    wait_until, d, submitted(len(gens)), SHORT_WAIT_S, "transfer submitted"
                )
            w = load(d)
            assert (w.transfer.in_flight_transfers, w.transfer.queued_transfers) == (1, 3)
            assert w.engine.num_transfer_blocks == 3 + 3 + 3 + -(-len(prompts[3]) // 16)

            ray.cancel(gens[0])  # in flight
            assert await d.abort.remote("mid-transfer-1") is True  # queued
            ray.cancel(gens[2])  # queued
            await expect_cancelled(gens[0])
            await expect_aborted(gens[1])
            await expect_cancelled(gens[2])
            await asyncio.to_thread(
                wait_until,
                d,
                lambda w: (
                    w.transfer.in_flight_transfers == 1
                    and w.transfer.queued_transfers == 0
                    and w.engine.num_transfer_blocks == -(-len(prompts[3]) // 16)
                    and w.inflight_requests == 1
                ),
                SHORT_WAIT_S,
                "only the last transfer left",
            )
            await d.open_gate.remote()
            chunks = await consume(gens[3])
            tokens = [results[3].first_token_id] + [t for c in chunks for t in c.token_ids]
            assert tokens == hf_greedy_to_eos(prompts[3], 12)
            await wait_idle_async(p, d)

        asyncio.run(run())
    finally:
        ray.get(d.open_gate.remote(), timeout=30)
    failed = ray.get(d.transfer_stats.remote(), timeout=30).transfers_failed
    assert failed - failed_before == 3


def test_abort_while_waiting_for_decode_kv_blocks_frees_every_block(workers: Workers) -> None:
    """Two gated 1900-token pulls hold 238 of the 256 decode blocks; a third request waits
    for 25 blocks, is aborted while it waits, and the others are cancelled."""
    d = workers.gated
    salt = "allocation-wait"
    big = [random_prompt(1900, 10), random_prompt(1900, 11)]
    small = random_prompt(400, 12)
    ray.get(d.close_gate.remote(), timeout=30)
    try:

        async def run() -> None:
            r0, r1, r2 = await asyncio.gather(
                prefill(workers.p0, "alloc-0", big[0], ENDLESS, salt),
                prefill(workers.p1, "alloc-1", big[1], ENDLESS, salt),
                prefill(workers.p1, "alloc-2", small, ENDLESS, salt),
            )
            g0 = open_stream(d, decode_request("alloc-0", big[0], ENDLESS, r0, salt))
            g1 = open_stream(d, decode_request("alloc-1", big[1], ENDLESS, r1, salt))
            await asyncio.to_thread(
                wait_until,
                d,
                lambda w: w.engine.num_transfer_blocks == 2 * 119,
                SHORT_WAIT_S,
                "two transfers reserved",
            )
            g2 = open_stream(d, decode_request("alloc-2", small, ENDLESS, r2, salt))
            await asyncio.to_thread(
                wait_until,
                d,
                lambda w: w.inflight_requests == 3,
                SHORT_WAIT_S,
                "third request waiting",
            )
            await asyncio.sleep(0.3)  # it is retrying the allocation
            w = load(d)
            assert w.engine.num_transfer_blocks == 238 and w.engine.num_free_blocks == 18
            await d.abort.remote("alloc-2")
            await expect_aborted(g2)
            ray.cancel(g0)
            ray.cancel(g1)
            await expect_cancelled(g0)
            await expect_cancelled(g1)
            await wait_idle_async(d)
            # The aborted request never reached its transfer: its lease is the caller's to
            # end (the router does). The cancelled ones' leases end by the decode worker's
            # notices (done or abort), well before they would expire.
            assert await workers.p1.abort.remote("alloc-2") is True
            await wait_idle_async(workers.p0, workers.p1)

        asyncio.run(run())
    finally:
        ray.get(d.open_gate.remote(), timeout=30)
        end_leases(workers.p0, "alloc-0")
        end_leases(workers.p1, "alloc-1", "alloc-2")


def test_a_fully_reused_prompt_ends_its_prefill_lease_promptly(
    workers: Workers, tokenizer, hf_greedy_to_eos: Reference
) -> None:
    """A decode worker that already caches every block of a prompt reads nothing: its
    `done` notice alone ends the prefill lease, well before `lease_s` (30 s here), even
    when it is the first message to that prefill worker."""
    p, d = workers.p1, workers.fresh
    salt = "full-reuse"
    text = (
        "The train leaves the station at ten past eight. It crosses the valley, passes the "
        "farms and the long rows of apple trees"
    )
    prompt = tokenizer.encode(text)[:48]
    assert len(prompt) == 48  # 3 full blocks, no partial one

    async def run() -> None:
        local = await serve(None, d, "reuse-local", prompt, greedy(4), salt)  # caches 3 blocks
        pulled = await serve(p, d, "reuse-pulled", prompt, greedy(4), salt)
        assert pulled.chunks[0].num_transferred_tokens == 0
        assert pulled.token_ids == local.token_ids == hf_greedy_to_eos(prompt, 4)
        await wait_idle_async(d)
        await wait_idle_async(p, timeout_s=LEASE_NOTICE_S)

    try:
        asyncio.run(run())
    finally:
        end_leases(p, "reuse-pulled")


def test_prefill_abort_frees_queued_work_and_held_leases(workers: Workers) -> None:
    """Two 1500-token prompts hold 188 blocks under leases; a third (94 blocks) cannot be
    admitted and waits; aborting it ends its call at once, aborting the others ends their
    leases."""
    p = workers.p1
    prompts = [random_prompt(1500, 20 + i) for i in range(3)]
    sp = greedy(8)

    async def run() -> None:
        a, b = await asyncio.gather(
            prefill(p, "pabort-0", prompts[0], sp), prefill(p, "pabort-1", prompts[1], sp)
        )
        assert a.handle is not None and b.handle is not None
        w = load(p)
        assert (w.leases_held, w.leased_blocks) == (2, 188)
        assert w.engine.num_free_blocks == NUM_KV_BLOCKS - 188
        waiting = asyncio.ensure_future(prefill(p, "pabort-2", prompts[2], sp))
        await asyncio.to_thread(
            wait_until, p, lambda w: w.engine.num_waiting == 1, SHORT_WAIT_S, "third queued"
        )
        assert await p.abort.remote("pabort-2") is True
        with pytest.raises(RequestAborted):
            await asyncio.wait_for(waiting, SHORT_WAIT_S)
        assert await p.abort.remote("pabort-0") is True
        assert await p.abort.remote("pabort-1") is True
        await wait_idle_async(p)
        assert await p.abort.remote("pabort-1") is False

    try:
        asyncio.run(run())
    finally:
        end_leases(p, "pabort-0", "pabort-1", "pabort-2")


def test_an_abort_that_comes_before_its_prefill_call_ends_that_call(workers: Workers) -> None:
    """Ray runs an async actor's calls as they arrive, not in their caller's order: a router
    that cancels a prefill call at once and aborts it can have the abort run first. The call
    that comes after its abort ends with `RequestAborted` and leases nothing, rather than
    leasing its blocks to nobody until `lease_s` (30 s here) runs out."""
    p = workers.p1

    async def run() -> None:
        assert await p.abort.remote("early-abort") is False  # nothing here yet
        with pytest.raises(RequestAborted):
            await prefill(p, "early-abort", random_prompt(100, 30), greedy(8))
        w = load(p)
        assert (w.leases_held, w.leased_blocks, w.inflight_requests) == (0, 0, 0)

    try:
        asyncio.run(run())
    finally:
        end_leases(p, "early-abort")
    wait_idle(p, timeout_s=LEASE_NOTICE_S)


def test_an_abort_that_comes_before_its_decode_call_ends_that_request(workers: Workers) -> None:
    """The decode side of the same race: a router that gives up on a `submit` and aborts the
    request can have the abort run first. A `submit` or `generate` that comes after its abort
    is accepted and its request ends at once with an ABORT chunk, having pulled, allocated and
    computed nothing, rather than decoding to `max_tokens` for nobody. The prefill lease of
    the pulled one is left to its caller (the router aborts it), as the decode side never
    read it."""
    p, d = workers.p0, workers.d0
    pulled_prompt = random_prompt(100, 31)

    def nothing_held(w: WorkerLoad) -> None:
        e = w.engine
        assert (e.num_running, e.num_waiting, e.num_transfer_blocks) == (0, 0, 0)
        assert (w.transfer.in_flight_transfers, w.transfer.queued_transfers) == (0, 0)
        assert w.inflight_requests == 0

    async def run() -> None:
        # generate, local prefill
        assert await d.abort.remote("early-local") is False  # nothing here yet
        gen = open_stream(d, decode_request("early-local", random_prompt(100, 30), ENDLESS))
        try:
            chunk = await next_chunk(gen, SHORT_WAIT_S)
            assert chunk is not None
            assert (chunk.finish_reason, chunk.token_ids) == (FinishReason.ABORT, ())
            assert await next_chunk(gen, SHORT_WAIT_S) is None
        finally:
            ray.cancel(gen)
        nothing_held(load(d))

        # submit on a token channel, with a KV handle to pull
        result = await prefill(p, "early-pulled", pulled_prompt, ENDLESS)
        assert result.handle is not None
        assert await d.abort.remote("early-pulled") is False
        reader = ChannelReader(d, "early-abort/0")
        try:
            await reader.submit(decode_request("early-pulled", pulled_prompt, ENDLESS, result))
            await reader.wait(lambda: bool(reader.items.get("early-pulled")), "its first item")
            items = reader.items["early-pulled"]
            assert len(items) == 1 and isinstance(items[0], TokenChunk)
            assert (items[0].finish_reason, items[0].token_ids) == (FinishReason.ABORT, ())
        finally:
            await reader.close()
        nothing_held(load(d))
        assert load(p).leases_held == 1  # never read: the router's abort ends it
        assert await p.abort.remote("early-pulled") is True

    try:
        asyncio.run(run())
    finally:
        ray.get([d.abort.remote(rid) for rid in ("early-local", "early-pulled")], timeout=30)
        end_leases(p, "early-pulled")
    wait_idle(d)
    wait_idle(p, timeout_s=LEASE_NOTICE_S)


def test_decode_drain_finishes_in_flight_streams_and_refuses_new_ones(
    workers: Workers, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    p, d = workers.p1, workers.d1
    prompts = corpus_prompts[16:20]

    async def run() -> None:
        results = await asyncio.gather(
            *(prefill(p, f"drain-d-{i}", x, greedy(24)) for i, x in enumerate(prompts))
        )
        assert all(r.handle is not None for r in results)
        gens = [
            open_stream(d, decode_request(r.request_id, x, greedy(24), r))
            for r, x in zip(results, prompts, strict=True)
        ]
        firsts = [await next_chunk(g) for g in gens]
        drained = d.drain.remote(60.0)
        await asyncio.to_thread(
            wait_until, d, lambda w: w.state is WorkerState.DRAINING, SHORT_WAIT_S, "draining"
        )
        late = await prefill(p, "drain-d-late", prompts[0], greedy(24))
        late_req = decode_request("drain-d-late", prompts[0], greedy(24), late)
        with pytest.raises(WorkerDraining):
            await consume(open_stream(d, late_req))
        assert await p.abort.remote("drain-d-late") is True  # the caller ends its lease
        for r, x, g, first in zip(results, prompts, gens, firsts, strict=True):
            chunks = [first, *await consume(g)]
            tokens = [r.first_token_id] + [t for c in chunks if c is not None for t in c.token_ids]
            assert tokens == hf_greedy_to_eos(x, 24)
        assert await asyncio.wait_for(drained, SHORT_WAIT_S) is True
        await d.undrain.remote()
        assert load(d).state is WorkerState.READY
        result = await prefill(p, "drain-d-after", prompts[1], greedy(24))
        after_req = decode_request("drain-d-after", prompts[1], greedy(24), result)
        chunks = await consume(open_stream(d, after_req))
        tokens = [result.first_token_id] + [t for c in chunks for t in c.token_ids]
        assert tokens == hf_greedy_to_eos(prompts[1], 24)

    asyncio.run(run())
    wait_idle(p, d)


def test_prefill_drain_waits_for_held_leases_and_refuses_new_prompts(
    workers: Workers, corpus_prompts: list[list[int]]
) -> None:
    p, d = workers.p1, workers.d1
    prompts = corpus_prompts[20:22]

    async def run() -> None:
        results = await asyncio.gather(
            *(prefill(p, f"drain-p-{i}", x, greedy(8)) for i, x in enumerate(prompts))
        )
        assert all(r.handle is not None for r in results)
        drained = p.drain.remote(60.0)
        ready, _ = await asyncio.to_thread(ray.wait, [drained], timeout=1.0)
        assert not ready, "drain returned while leases were held"
        assert load(p).state is WorkerState.DRAINING
        with pytest.raises(WorkerDraining):
            await prefill(p, "drain-p-late", prompts[0], greedy(8))
        for r, x in zip(results, prompts, strict=True):
            await consume(open_stream(d, decode_request(r.request_id, x, greedy(8), r)))
        assert await asyncio.wait_for(drained, SHORT_WAIT_S) is True
        await p.undrain.remote()
        assert (await prefill(p, "drain-p-after", prompts[0], greedy(8))).handle is not None
        await p.abort.remote("drain-p-after")

    asyncio.run(run())
    wait_idle(p, d)
