"""The decode worker's token channel on its own (no Ray, no engine): what one batch holds,
how a request's outputs merge, that every request ends with exactly one last item, how
subscriptions attach, replace each other and end, and when the registry closes channels
nobody reads."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from decode_worker.channel import ChannelRegistry, ChannelState, OutputChannel, RequestSink
from vocabulary.decode_api import ChunkError, TokenChunk
from vocabulary.engine_io import FinishReason, RequestOutput, RequestTimings
from vocabulary.transfer_errors import TransferTimeout
from vocabulary.worker_api import RequestAborted

T = TypeVar("T")


def run(body: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(body())  # type: ignore[arg-type]


def output(
    rid: str, *tokens: int, finish: FinishReason | None = None, arrival: float = 100.0
) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        new_token_ids=tokens,
        text_delta="".join(chr(ord("a") + t % 26) for t in tokens),
        logprobs=None,
        finish_reason=finish,
        stop_reason=None,
        num_prompt_tokens=5,
        num_output_tokens=len(tokens),
        num_cached_prompt_tokens=0,
        timings=RequestTimings(arrival=arrival, first_scheduled=arrival + 0.5,
                               first_token=arrival + 0.75),
    )  # fmt: skip


def sink(channel: OutputChannel, rid: str) -> RequestSink:
    s = RequestSink(channel, rid)
    channel.adopt(s)
    return s


def test_outputs_of_one_step_for_many_requests_come_as_one_batch() -> None:
    async def body() -> None:
        ch = OutputChannel("c")
        epoch = ch.attach()
        sinks = [sink(ch, f"r{i}") for i in range(3)]
        for i, s in enumerate(sinks):
            s.put_nowait(output(f"r{i}", 10 + i))
        batch = await ch.next_batch(epoch)
        assert batch is not None
        assert [(rid, c.token_ids) for rid, c in batch] == [  # type: ignore[misc]
            ("r0", (10,)),
            ("r1", (11,)),
            ("r2", (12,)),
        ]
        assert ch.info().open_requests == 3

    run(body)


def test_outputs_that_pile_up_merge_and_only_the_first_chunk_reports_the_transfer() -> None:
    async def body() -> None:
        ch = OutputChannel("c")
        epoch = ch.attach()
        s = sink(ch, "r")
        s.num_transferred_tokens, s.transfer_s = 40, 0.25
        s.put_nowait(output("r", 1))
        s.put_nowait(output("r", 2, 3))
        (first,) = await ch.next_batch(epoch) or []
        s.put_nowait(output("r", 4))
        (second,) = await ch.next_batch(epoch) or []
        assert isinstance(first, tuple) and isinstance(second, tuple)
        a, b = first[1], second[1]
        assert (a.token_ids, a.text, a.num_transferred_tokens, a.transfer_s) == (
            (1, 2, 3), "bcd", 40, 0.25,
        )  # fmt: skip
        assert (a.queue_s, a.prefill_s) == (0.5, 0.25)
        assert (b.token_ids, b.num_transferred_tokens, b.transfer_s, b.queue_s) == ((4,), 0, 0, 0)

    run(body)


def test_the_finishing_output_resolves_done_and_is_the_requests_last_item() -> None:
    async def body() -> None:
        ch = OutputChannel("c")
        epoch = ch.attach()
        s = sink(ch, "r")
        s.put_nowait(output("r", 7, finish=FinishReason.LENGTH))
        assert s.done.done() and s.done.result() is None
        s.put_nowait(output("r", 8))  # nothing follows the last item
        s.end(ChunkError("r", RequestAborted("late")))
        batch = await ch.next_batch(epoch)
        assert batch is not None and len(batch) == 1
        rid, chunk = batch[0]  # type: ignore[misc]
        assert (rid, chunk.token_ids, chunk.finish_reason) == ("r", (7,), FinishReason.LENGTH)
        assert ch.info().open_requests == 0  # its last item was taken: it left the channel
        assert not ch._ready

    run(body)


def test_an_error_resolves_done_and_its_chunk_error_follows_the_tokens_already_made() -> None:
    async def body() -> None:
        ch = OutputChannel("c")
        epoch = ch.attach()
        s, other = sink(ch, "r"), sink(ch, "o")
        s.put_nowait(output("r", 1))
        error = TransferTimeout("too slow")
        s.put_nowait(error)  # as the runtime delivers it (abort, failed step, stop)
        assert s.done.result() is error
        s.end(ChunkError("r", error))  # the pipeline's last word
        other.put_nowait(output("o", 2))
        batch = await ch.next_batch(epoch)
        assert batch == [
            ("r", batch[0][1]),  # type: ignore[index]
            ChunkError("r", error),
            ("o", batch[2][1]),  # type: ignore[index]
        ]
        assert ch.info().open_requests == 1

    run(body)


def test_an_aborted_request_ends_with_an_abort_chunk_after_its_tokens() -> None:
    async def body() -> None:
        ch = OutputChannel("c")
        epoch = ch.attach()
        s = sink(ch, "r")
        s.put_nowait(output("r", 1, 2))
        s.end(TokenChunk((), "", finish_reason=FinishReason.ABORT))
        batch = await ch.next_batch(epoch) or []
        assert [(rid, c.token_ids, c.finish_reason) for rid, c in batch] == [  # type: ignore[misc]
            ("r", (1, 2), None),
            ("r", (), FinishReason.ABORT),
        ]

    run(body)


def test_a_newer_subscription_replaces_the_older_which_ends() -> None:
    async def body() -> None:
        ch = OutputChannel("c")
        old = ch.attach()
        reader = asyncio.ensure_future(ch.next_batch(old))
        await asyncio.sleep(0)
        new = ch.attach()
        assert await asyncio.wait_for(reader, 1) is None
        assert not ch.detach(old)  # the old reader's end does not detach the new one
        assert ch.state is ChannelState.ATTACHED
        s = sink(ch, "r")
        s.put_nowait(output("r", 5))
        assert await ch.next_batch(new) is not None
        assert ch.detach(new) and ch.state is ChannelState.DETACHED

    run(body)


def test_a_closed_channel_hands_over_what_is_left_then_ends() -> None:
    async def body() -> None:
        ch = OutputChannel("c")
        epoch = ch.attach()
        sink(ch, "r").put_nowait(output("r", 3))
        ch.close()
        assert await ch.next_batch(epoch) is not None
        assert await asyncio.wait_for(ch.next_batch(epoch), 1) is None

    run(body)


def test_outputs_wait_on_a_channel_without_subscriber_until_one_attaches() -> None:
    async def body() -> None:
        ch = OutputChannel("c")
        sink(ch, "r").put_nowait(output("r", 1))
        sink(ch, "r").put_nowait(output("r", 2))  # a second request with the same id
        epoch = ch.attach()
        batch = await ch.next_batch(epoch) or []
        assert [c.token_ids for _, c in batch] == [(1,), (2,)]  # type: ignore[misc]

    run(body)


def registry(aborted: list[str], orphan_s: float = 0.05) -> ChannelRegistry:
    return ChannelRegistry(asyncio.get_running_loop(), aborted.append, orphan_s)


def test_a_subscription_that_ends_with_no_request_open_forgets_its_channel() -> None:
    async def body() -> None:
        aborted: list[str] = []
        reg = registry(aborted)
        ch = reg.get("c")
        epoch = reg.attach(ch, None)
        assert [i.channel_id for i in reg.infos()] == ["c"]
        reg.detach(ch, epoch)
        assert reg.infos() == [] and ch.state is ChannelState.CLOSED
        assert reg.get("c") is not ch  # a later subscription opens a fresh one
        await asyncio.sleep(0.1)
        assert aborted == []

    run(body)


def test_a_channel_left_without_subscriber_is_closed_and_its_requests_aborted() -> None:
    async def body() -> None:
        aborted: list[str] = []
        reg = registry(aborted, orphan_s=0.5)  # (long enough that a loaded machine keeps order)
        ch = reg.get("c")
        epoch = reg.attach(ch, None)
        sink(ch, "r1")
        sink(ch, "r2")
        reg.detach(ch, epoch)
        await asyncio.sleep(0.02)
        assert aborted == [] and ch.state is ChannelState.DETACHED
        for _ in range(100):  # closed once orphan_s has passed (polled, 5 s at most)
            if ch.state is ChannelState.CLOSED:
                break
            await asyncio.sleep(0.05)
        assert sorted(aborted) == ["r1", "r2"]
        assert ch.state is ChannelState.CLOSED and reg.infos() == []

    run(body)


def test_a_subscriber_that_comes_back_in_time_keeps_the_channel() -> None:
    async def body() -> None:
        aborted: list[str] = []
        reg = registry(aborted)
        ch = reg.get("c")  # a submit came first: no subscriber yet
        sink(ch, "r1")
        reg.attach(reg.get("c"), None)
        await asyncio.sleep(0.1)
        assert aborted == [] and ch.state is ChannelState.ATTACHED

    run(body)


def test_a_lease_not_renewed_closes_the_channel_its_reader_and_aborts_its_requests() -> None:
    async def body() -> None:
        aborted: list[str] = []
        reg = registry(aborted, orphan_s=10.0)
        ch = reg.get("c")
        # a lease of 0.5 s renewed every 0.1 s: the renewals hold it past its length even on
        # a loaded machine (a 0.06 s lease renewed every 0.03 s lapsed at load average ~9)
        epoch = reg.attach(ch, 0.5)
        sink(ch, "r1")
        for _ in range(8):  # renewed: the lease holds past its length
            await asyncio.sleep(0.1)
            assert reg.renew("c")
        assert aborted == [] and ch.state is ChannelState.ATTACHED
        reader = asyncio.ensure_future(ch.next_batch(epoch))
        for _ in range(100):  # no renewal now: it lapses within its length (polled, 5 s at most)
            if ch.state is ChannelState.CLOSED:
                break
            await asyncio.sleep(0.05)
        assert aborted == ["r1"] and ch.state is ChannelState.CLOSED
        assert await asyncio.wait_for(reader, 1) is None  # the subscription ends
        assert not reg.renew("c")

    run(body)
