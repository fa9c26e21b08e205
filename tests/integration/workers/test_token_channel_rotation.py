"""The router's token channel replaces its subscription to a real decode worker every few
batches (router/decode_channel.py, `resubscribe_after`): requests opened across many
rotations each get exactly their own tokens, the drained subscriptions end, and the worker
forgets their channels."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from pd_client import decode_request, greedy, wait_idle
from references import Reference
from workers_harness import Workers

from router.decode_channel import DecodeChannel

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 24


def test_requests_across_subscription_rotations_get_exactly_their_tokens(
    workers: Workers, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    d = workers.d0
    prefix = f"rotating-{uuid.uuid4().hex[:8]}"
    salt = uuid.uuid4().hex

    async def run() -> None:
        channel = DecodeChannel("d0", d, prefix, resubscribe_after=3)
        draining: list[int] = []
        prompts = corpus_prompts[:16]
        # request i opens once request i-1 has read 3 chunks (or ended): its subscription has
        # carried resubscribe_after batches by then, whatever the machine's speed, so each
        # open rotates while the one before still streams
        streaming = [asyncio.Event() for _ in prompts]

        async def one(i: int, prompt: list[int]) -> list[int]:
            if i:
                await asyncio.wait_for(streaming[i - 1].wait(), 60)
            rid = f"rot-{i}"
            stream = channel.open_request(rid)
            draining.append(channel.num_draining)
            try:
                await stream.submit(decode_request(rid, prompt, greedy(MAX_TOKENS), None, salt))
                tokens: list[int] = []
                chunks = 0
                while True:
                    chunk = await asyncio.wait_for(stream.next(), 60)
                    tokens.extend(chunk.token_ids)
                    chunks += 1
                    if chunks >= 3 or chunk.finish_reason is not None:
                        streaming[i].set()
                    if chunk.finish_reason is not None:
                        return tokens
            finally:
                streaming[i].set()
                stream.close()

        try:
            outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
                assert out == hf_greedy_to_eos(prompt, MAX_TOKENS), f"request {i}"
            assert channel.num_subscriptions >= 3 and max(draining) > 0  # rotated mid-stream
            assert channel.num_open == 0 and channel.num_draining == 0
            await asyncio.sleep(0.5)  # the drained subscriptions' cancellations land
            held = [c.channel_id for c in await d.channels.remote()]
            assert [c for c in held if c.startswith(prefix)] == [channel.channel_id]
        finally:
            channel.close()
            await channel.wait_closed()
        await asyncio.sleep(0.5)
        assert not [c for c in await d.channels.remote() if c.channel_id.startswith(prefix)]

    asyncio.run(run())
    wait_idle(d)
