"""A decode worker's token channel (one subscription per caller, requests submitted on it):
many concurrent requests each get exactly their own tokens, several per Ray item; a worker
killed mid-stream fails the whole channel at once; an aborted request frees its blocks while
the others on the same channel go on; a channel left without subscriber, or whose caller
died (lease not renewed), is closed and its requests aborted."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from channel_client import ChannelReader, engine_blocks, request_of
from pd_client import decode_request, greedy, load, prefill, wait_idle, wait_idle_async
from references import Reference
from workers_harness import PLACEMENT, START_TIMEOUT_S, Workers, worker_config

from deploy.control.worker_actors import create_worker
from kv_transfer.config import KVTransferConfig
from vocabulary.decode_api import TokenChunk
from vocabulary.engine_io import FinishReason
from vocabulary.worker_api import WorkerDraining, WorkerRole

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 24
ENDLESS = greedy(3000, ignore_eos=True)
ERROR_WITHIN_S = 30.0


def channel_id(tag: str) -> str:
    return f"test-{tag}-{uuid.uuid4().hex[:8]}"


def test_32_concurrent_requests_on_one_channel_each_get_exactly_their_own_tokens(
    workers: Workers, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    """Half the requests are pulled from two prefill workers, half prefilled on the decode
    worker; all share one channel, so most batches carry several requests' tokens."""
    d, prefills = workers.d0, (workers.p0, workers.p1)

    base = uuid.uuid4().hex  # a salt per request: nothing cached, every pull moves blocks

    async def one(reader: ChannelReader, i: int, prompt: list[int]) -> str:
        rid, salt = f"chan-{i}", f"{base}-{i}"
        result = None
        sp = greedy(MAX_TOKENS)
        if i % 2 == 0:
            result = await prefill(prefills[i // 2 % 2], rid, prompt, sp, salt)
            if result.handle is None:  # ended on its first token: nothing to decode
                return ""
        await reader.submit(decode_request(rid, prompt, sp, result, salt))
        return rid

    async def run() -> None:
        reader = ChannelReader(d, channel_id("exact"))
        try:
            submitted = await asyncio.gather(
                *(one(reader, i, p) for i, p in enumerate(corpus_prompts))
            )
            rids = [r for r in submitted if r]
            await reader.wait_ended(rids)
            for i, (prompt, rid) in enumerate(zip(corpus_prompts, submitted, strict=True)):
                if not rid:
                    continue
                items = reader.items[rid]
                assert all(isinstance(c, TokenChunk) for c in items), items
                chunks: list[TokenChunk] = items  # type: ignore[assignment]
                expected = hf_greedy_to_eos(prompt, MAX_TOKENS)
                first_token = [] if i % 2 else [expected[0]]  # pulled: sent by the prefill
                assert first_token + reader.tokens(rid) == expected, f"request {i}"
                assert all(c.finish_reason is None for c in chunks[:-1])
                last = chunks[-1]
                assert last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                assert last.num_prompt_tokens == len(prompt)
                assert last.num_output_tokens == len(expected)
                pulled = chunks[0].num_transferred_tokens
                assert (pulled > 0 and chunks[0].transfer_s > 0) if i % 2 == 0 else pulled == 0
                assert sum(c.num_transferred_tokens for c in chunks[1:]) == 0
            # Batching: fewer Ray items than chunks, and batches with several requests.
            num_chunks = sum(len(reader.items[r]) for r in rids)
            widest = max(len({request_of(item) for item in b}) for b in reader.batches)
            assert len(reader.batches) < num_chunks and widest > 1
            (info,) = [c for c in await d.channels.remote() if c.channel_id == reader.channel_id]
            assert info.subscribed and info.open_requests == 0
        finally:
            await reader.close()
        # The subscription ended with no request open: the worker forgets the channel.
        await asyncio.sleep(0.5)
        assert reader.channel_id not in {c.channel_id for c in await d.channels.remote()}

    asyncio.run(run())
    wait_idle(*prefills, d)


def test_an_aborted_request_frees_its_blocks_while_the_others_on_its_channel_go_on(
    workers: Workers, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    """The router cancels a request with `abort`: it ends with an ABORT chunk on the
    channel, every block it held is free again (all blocks in use belong to the other
    requests) while those are still decoding, and they finish with exactly their tokens."""
    d, p = workers.d0, workers.p1
    n = 48
    long_runs = [x for x in corpus_prompts if len(x) > 8 and len(hf_greedy_to_eos(x, n)) == n][:3]
    assert len(long_runs) == 3, "need 3 prompts that do not end on eos within 48 tokens"
    victim_prompt = [t for x in corpus_prompts[:12] for t in x][:300]  # 19 blocks
    salt = uuid.uuid4().hex  # no block shared with anything: per-request counts add up
    wait_idle(d)

    async def run() -> None:
        reader = ChannelReader(d, channel_id("abort"))
        try:
            pulled = await asyncio.gather(
                *(prefill(p, f"keep-{i}", x, greedy(n), f"{salt}-{i}") for i, x in
                  enumerate(long_runs[:2]))
            )  # fmt: skip
            assert all(r.handle is not None for r in pulled)
            await reader.submit(decode_request("victim", victim_prompt, ENDLESS, None, salt))
            keep = ["keep-0", "keep-1", "keep-2"]
            for i, r in enumerate(pulled):
                await reader.submit(decode_request(keep[i], long_runs[i], greedy(n), r,
                                                   f"{salt}-{i}"))  # fmt: skip
            await reader.submit(decode_request("keep-2", long_runs[2], greedy(n), None,
                                               f"{salt}-2"))  # fmt: skip
            await reader.wait(lambda: all(reader.items[r] for r in ["victim", *keep]),
                              "every request decoding")  # fmt: skip
            used, held = await asyncio.to_thread(engine_blocks, d)
            assert held["victim"] >= 19 and used == sum(held.values())

            assert await d.abort.remote("victim") is True
            await reader.wait(lambda: reader.ended("victim"), "the ABORT chunk")
            last = reader.items["victim"][-1]
            assert isinstance(last, TokenChunk) and last.finish_reason is FinishReason.ABORT
            used, held = await asyncio.to_thread(engine_blocks, d)
            assert "victim" not in held and used == sum(held.values())
            assert held, "the other requests already finished: nothing shows they go on"

            await reader.wait_ended(keep)
            at_abort = next(i for i, (rid, c) in enumerate(reader.seq) if rid == "victim"
                            and isinstance(c, TokenChunk) and c.finish_reason)  # fmt: skip
            assert any(rid in keep for rid, _ in reader.seq[at_abort + 1 :])
            for i, rid in enumerate(keep):
                first = [pulled[i].first_token_id] if i < 2 else []
                assert first + reader.tokens(rid) == hf_greedy_to_eos(long_runs[i], n), rid
            (info,) = [c for c in await d.channels.remote() if c.channel_id == reader.channel_id]
            assert info.open_requests == 0
        finally:
            await reader.close()
        await wait_idle_async(p, d)

    asyncio.run(run())


@pytest.fixture(scope="module")
def channel_victim(workers: Workers, tiny_model_dir: Path, redis_url: str) -> Iterator[Any]:
    """A decode worker of this module's own: the test kills it."""
    config = worker_config(tiny_model_dir, "chvictim", WorkerRole.DECODE, redis_url)
    handle = create_worker(config, KVTransferConfig(lease_s=30.0), PLACEMENT)
    ray.get(handle.start.remote(), timeout=START_TIMEOUT_S)
    yield handle
    ray.kill(handle)


def test_killing_a_decode_worker_mid_stream_fails_its_channel_at_once(
    workers: Workers, channel_victim: Any, corpus_prompts: list[list[int]]
) -> None:
    p, victim = workers.p0, channel_victim
    prompts = corpus_prompts[24:30]

    async def run() -> float:
        reader = ChannelReader(victim, channel_id("kill"))
        try:
            results = await asyncio.gather(
                *(prefill(p, f"chkill-pd-{i}", x, ENDLESS) for i, x in enumerate(prompts[:4]))
            )
            rids = [r.request_id for r in results] + ["chkill-local-0", "chkill-local-1"]
            for r, x in zip(results, prompts[:4], strict=True):
                await reader.submit(decode_request(r.request_id, x, ENDLESS, r))
            for i, x in enumerate(prompts[4:]):
                await reader.submit(decode_request(f"chkill-local-{i}", x, ENDLESS))
            await reader.wait(lambda: all(len(reader.items[r]) >= 2 for r in rids),
                              "two chunks of every request")  # fmt: skip
            ray.kill(victim, no_restart=True)
            t0 = time.monotonic()
            with pytest.raises(ray.exceptions.RayActorError):
                await reader.wait(lambda: False, "the subscription's error", ERROR_WITHIN_S)
            elapsed = time.monotonic() - t0
            assert not any(reader.ended(r) for r in rids)  # no request ended any other way
            with pytest.raises(ray.exceptions.RayActorError):
                await asyncio.wait_for(
                    victim.submit.remote(decode_request("late", prompts[0], ENDLESS), "x"),
                    ERROR_WITHIN_S,
                )
            return elapsed
        finally:
            await reader.close()

    elapsed = asyncio.run(run())
    assert elapsed < ERROR_WITHIN_S
    wait_idle(p)  # the hand-offs had completed before the kill: no lease waits for expiry


def test_a_channel_left_without_subscriber_aborts_its_requests(
    workers: Workers, corpus_prompts: list[list[int]]
) -> None:
    """The caller subscribed, submitted, and went away without aborting: the worker gives a
    subscriber `CHANNEL_ORPHAN_S` to come back, then aborts the requests (blocks freed)."""
    d = workers.d1
    cid = channel_id("orphan")

    async def run() -> None:
        reader = ChannelReader(d, cid)
        await reader.submit(decode_request("orphan-0", corpus_prompts[3], ENDLESS))
        await reader.wait(lambda: bool(reader.items["orphan-0"]), "first chunk")
        await reader.close()
        assert load(d).inflight_requests == 1
        # The channel is closed CHANNEL_ORPHAN_S (10 s) after the subscriber left, then its
        # request aborted. (On a slow host the request may have ended at its length first:
        # the channel stays, for a subscriber to come back for its end, until the same timer.)
        deadline = time.monotonic() + 20.0
        while cid in {c.channel_id for c in await d.channels.remote()}:
            assert time.monotonic() < deadline, "orphaned channel still open after 20 s"
            await asyncio.sleep(0.1)
        await wait_idle_async(d, timeout_s=10.0)

    asyncio.run(run())


def test_submit_refuses_at_once_what_the_worker_cannot_hold(
    workers: Workers, corpus_prompts: list[list[int]]
) -> None:
    """Refusals are raised by `submit` itself (the router re-places on them), never sent
    down the channel: an id already in flight, a draining worker."""
    d = workers.d1

    async def run() -> None:
        reader = ChannelReader(d, channel_id("refuse"))
        try:
            req = decode_request("refuse-0", corpus_prompts[0], greedy(8))
            await reader.submit(req)
            with pytest.raises(ValueError, match="already in flight"):
                await reader.submit(req)
            await reader.wait_ended(["refuse-0"])
            assert all(isinstance(c, TokenChunk) for c in reader.items["refuse-0"])
            assert await d.drain.remote(5.0) is True
            try:
                with pytest.raises(WorkerDraining):
                    await reader.submit(decode_request("refuse-1", corpus_prompts[1], greedy(8)))
            finally:
                await d.undrain.remote()
            assert "refuse-1" not in reader.items
        finally:
            await reader.close()

    asyncio.run(run())
    wait_idle(d)


ROUTER_THAT_DIES = """
import asyncio, os, sys
import ray
from vocabulary.decode_api import DecodeRequest
from vocabulary.sampling import SamplingParams
from router.decode_channel import DecodeChannel

ray.init(address=sys.argv[1], namespace=sys.argv[2], log_to_driver=False)
handle = ray.get_actor(sys.argv[3])
lease_s = float(sys.argv[4])

async def main():
    channel = DecodeChannel("d", handle, "dying-router", lease_s=lease_s)
    sp = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
    streams = []
    for i in range(3):
        s = channel.open_request(f"dying-{i}")
        await s.submit(DecodeRequest(f"dying-{i}", (1, 40 + i, 7, 9, 11), sp))
        streams.append(s)
    await asyncio.sleep(2 * lease_s)  # renewed meanwhile: the worker keeps serving them
    for s in streams:
        chunk = await asyncio.wait_for(s.next(), 30)
        assert chunk.finish_reason is None, chunk
    print("alive after", 2 * lease_s, "s; dying", flush=True)
    os._exit(0)  # no abort, no close: as a router process that is killed

asyncio.run(main())
"""


def test_requests_of_a_router_process_that_dies_are_aborted_once_its_lease_runs_out(
    workers: Workers,
) -> None:
    """Ray keeps an actor's streaming call running when its caller dies, so the worker holds
    the router's channel on a lease: renewed, the requests live past it; once the router
    is gone, the channel closes and its requests are aborted within the lease."""
    import os
    import subprocess
    import sys

    d, lease_s = workers.d1, 2.0
    wait_idle(d)
    ctx = ray.get_runtime_context()
    repo = Path(__file__).resolve().parents[3]
    child = subprocess.run(
        [sys.executable, "-c", ROUTER_THAT_DIES, ctx.gcs_address, ctx.namespace,
         "pdserve-worker-d1", str(lease_s)],
        cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == 0 and "dying" in child.stdout, child.stderr[-2000:]
    t0 = time.monotonic()
    wait_idle(d, timeout_s=lease_s + 15)
    assert time.monotonic() - t0 < lease_s + 15
    assert not [c for c in ray.get(d.channels.remote(), timeout=30)
                if c.channel_id.startswith("dying-router/")]  # fmt: skip
