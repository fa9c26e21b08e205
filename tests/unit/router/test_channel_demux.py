"""The router's token channel against a fake decode actor (no Ray): items reach their own
request, typed worker errors come out as raised, a broken subscription fails every open
request and the next request subscribes again, a subscription that carried enough batches
hands new requests to a fresh one and drains, nothing is left registered after, and a
stopped subscription's call is let go of once its reader has ended."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pytest
from ray.exceptions import RayActorError

from router.decode_channel import ChannelState, DecodeChannel
from router.errors import WorkerLost
from vocabulary.decode_api import ChannelItem, ChunkError, DecodeRequest, TokenChunk
from vocabulary.engine_io import FinishReason
from vocabulary.sampling import SamplingParams
from vocabulary.transfer_errors import LeaseExpired

T = TypeVar("T")


def run(body: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(body())  # type: ignore[arg-type]


async def _value(v: Any) -> Any:
    return v


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def options(self, **_: Any) -> _Method:
        return self

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeDecodeActor:
    """Stands in for a decode actor handle: `subscribe` streams what the test `send`s (an
    exception ends the stream with it), `submit` and `renew` record their arguments."""

    def __init__(self) -> None:
        self.subscriptions: list[str] = []
        self.leases: list[float] = []
        self.renewals: list[str] = []
        self.submitted: list[tuple[str, str]] = []
        self._feeds: list[asyncio.Queue[list[ChannelItem] | BaseException | None]] = []
        self.calls: list[weakref.ref[AsyncIterator[Awaitable[list[ChannelItem]]]]] = []
        """Each subscription's call, weakly (a Ray generator frees its record when deleted)."""
        self.subscribe = _Method(self._subscribe)
        self.submit = _Method(lambda req, cid: _value(self.submitted.append((req.request_id,
                                                                             cid))))  # fmt: skip
        self.renew = _Method(self.renewals.append)

    def _subscribe(
        self, channel_id: str, lease_s: float
    ) -> AsyncIterator[Awaitable[list[ChannelItem]]]:
        self.subscriptions.append(channel_id)
        self.leases.append(lease_s)
        feed: asyncio.Queue[list[ChannelItem] | BaseException | None] = asyncio.Queue()
        self._feeds.append(feed)

        async def stream() -> AsyncIterator[Awaitable[list[ChannelItem]]]:
            while (item := await feed.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield _value(item)

        call = stream()
        self.calls.append(weakref.ref(call))
        return call

    def send(self, item: list[ChannelItem] | BaseException | None, to: int = -1) -> None:
        """Into subscription number `to` (the latest by default)."""
        self._feeds[to].put_nowait(item)


def request(rid: str) -> DecodeRequest:
    return DecodeRequest(rid, (1, 2, 3), SamplingParams(max_tokens=4))


def chunk(*tokens: int, finish: FinishReason | None = None) -> TokenChunk:
    return TokenChunk(tokens, "", finish_reason=finish)


def test_items_reach_their_own_request_and_ids_not_open_are_dropped() -> None:
    async def body() -> None:
        actor = FakeDecodeActor()
        ch = DecodeChannel("d0", actor, "router-a")
        a, b = ch.open_request("a"), ch.open_request("b")
        await a.submit(request("a"))
        await b.submit(request("b"))
        assert actor.subscriptions == ["router-a/d0/0"]
        assert actor.submitted == [("a", "router-a/d0/0"), ("b", "router-a/d0/0")]
        actor.send([("b", chunk(5)), ("gone", chunk(9)), ("a", chunk(1, 2)), ("b", chunk(6))])
        actor.send([("a", chunk(3, finish=FinishReason.LENGTH))])
        assert (await a.next()).token_ids == (1, 2)
        assert (await a.next()).finish_reason is FinishReason.LENGTH
        assert [(await b.next()).token_ids for _ in range(2)] == [(5,), (6,)]
        a.close()
        b.close()
        a.close()  # idempotent
        assert ch.num_open == 0 and ch.num_batches == 2
        ch.close()

    run(body)


def test_a_chunk_error_raises_the_workers_typed_error_for_that_request_only() -> None:
    async def body() -> None:
        actor = FakeDecodeActor()
        ch = DecodeChannel("d0", actor, "r")
        a, b = ch.open_request("a"), ch.open_request("b")
        actor.send([ChunkError("a", LeaseExpired("lease over")), ("b", chunk(4))])
        with pytest.raises(LeaseExpired, match="lease over"):
            await a.next()
        assert (await b.next()).token_ids == (4,)
        ch.close()

    run(body)


def test_actor_death_fails_every_open_request_marks_the_worker_and_the_next_resubscribes() -> None:
    async def body() -> None:
        actor = FakeDecodeActor()
        deaths: list[str] = []
        ch = DecodeChannel("d0", actor, "r", on_worker_death=lambda: deaths.append("d0"))
        streams = [ch.open_request(f"q{i}") for i in range(3)]
        actor.send([("q0", chunk(1))])
        assert (await streams[0].next()).token_ids == (1,)
        actor.send(RayActorError())
        for s in streams:
            with pytest.raises(WorkerLost, match="decode worker d0 lost: RayActorError"):
                await asyncio.wait_for(s.next(), 1)
        assert deaths == ["d0"]
        assert ch.state is ChannelState.BROKEN and ch.num_open == 0
        again = ch.open_request("q9")
        assert actor.subscriptions == ["r/d0/0", "r/d0/1"]  # a fresh channel id
        actor.send([("q9", chunk(2))])
        assert (await again.next()).token_ids == (2,)
        ch.close()

    run(body)


def test_a_subscription_that_ends_fails_its_open_requests_with_worker_lost() -> None:
    async def body() -> None:
        actor = FakeDecodeActor()
        ch = DecodeChannel("d0", actor, "r")
        s = ch.open_request("a")
        actor.send(None)  # the worker ended the stream (shutdown)
        with pytest.raises(WorkerLost, match="ended token channel r/d0/0"):
            await asyncio.wait_for(s.next(), 1)
        assert ch.state is ChannelState.BROKEN

    run(body)


def test_close_fails_open_requests_and_refuses_new_ones() -> None:
    async def body() -> None:
        actor = FakeDecodeActor()
        ch = DecodeChannel("d0", actor, "r")
        s = ch.open_request("a")
        ch.close("decode worker d0 left the cluster")
        await ch.wait_closed()
        with pytest.raises(WorkerLost, match="left the cluster"):
            await s.next()
        with pytest.raises(WorkerLost):
            ch.open_request("b")
        assert ch.num_open == 0

    run(body)


def test_the_subscription_lease_is_renewed_while_the_channel_is_open() -> None:
    async def body() -> None:
        actor = FakeDecodeActor()
        ch = DecodeChannel("d0", actor, "r", lease_s=0.08)
        ch.open_request("a")
        await asyncio.sleep(0.1)
        assert actor.leases == [0.08]
        assert len(actor.renewals) >= 2 and set(actor.renewals) == {"r/d0/0"}
        ch.close()
        await ch.wait_closed()
        renewed = len(actor.renewals)
        await asyncio.sleep(0.05)
        assert len(actor.renewals) == renewed  # none after the close

    run(body)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_after_enough_batches_new_requests_go_to_a_fresh_subscription_and_the_old_drains() -> None:
    async def body() -> None:
        actor = FakeDecodeActor()
        ch = DecodeChannel("d0", actor, "r", resubscribe_after=2)
        a = ch.open_request("a")
        await a.submit(request("a"))
        actor.send([("a", chunk(1))])
        actor.send([("a", chunk(2))])
        assert [(await a.next()).token_ids for _ in range(2)] == [(1,), (2,)]
        b = ch.open_request("b")  # the first subscription carried 2 batches: a fresh one
        await b.submit(request("b"))
        assert actor.subscriptions == ["r/d0/0", "r/d0/1"]
        assert actor.submitted == [("a", "r/d0/0"), ("b", "r/d0/1")]
        assert ch.channel_id == "r/d0/1" and ch.num_draining == 1 and ch.num_open == 2
        # Each request stays on its own subscription: a's tokens still come on the first.
        actor.send([("a", chunk(3, finish=FinishReason.LENGTH)), ("b", chunk(8))], to=0)
        actor.send([("b", chunk(4)), ("a", chunk(9))], to=1)
        assert (await a.next()).token_ids == (3,)
        assert (await b.next()).token_ids == (4,)
        assert ch.state is ChannelState.OPEN and ch.num_batches == 4
        a.close()  # the draining subscription's last request: it is stopped
        assert ch.num_draining == 0 and ch.num_open == 1
        actor.send([("b", chunk(5, finish=FinishReason.LENGTH))])
        assert (await b.next()).token_ids == (5,)
        b.close()
        ch.close()
        await ch.wait_closed()
        assert ch.num_subscriptions == 2

    run(body)


def test_a_subscription_with_no_request_open_is_replaced_at_once_not_drained() -> None:
    async def body() -> None:
        actor = FakeDecodeActor()
        ch = DecodeChannel("d0", actor, "r", resubscribe_after=1)
        a = ch.open_request("a")
        actor.send([("a", chunk(1, finish=FinishReason.LENGTH))])
        assert (await a.next()).finish_reason is FinishReason.LENGTH
        a.close()
        ch.open_request("b")
        assert actor.subscriptions == ["r/d0/0", "r/d0/1"] and ch.num_draining == 0
        ch.close()
        await ch.wait_closed()

    run(body)


def test_a_draining_subscription_that_fails_fails_only_its_own_requests() -> None:
    async def body() -> None:
        actor = FakeDecodeActor()
        ch = DecodeChannel("d0", actor, "r", resubscribe_after=1)
        a = ch.open_request("a")
        actor.send([("a", chunk(1))])
        assert (await a.next()).token_ids == (1,)
        b = ch.open_request("b")
        actor.send(RuntimeError("stream reset"), to=0)
        with pytest.raises(WorkerLost, match="lost: RuntimeError: stream reset"):
            await asyncio.wait_for(a.next(), 1)
        await _settle()
        assert ch.state is ChannelState.OPEN and ch.num_draining == 0 and ch.num_open == 1
        actor.send([("b", chunk(2))])
        assert (await b.next()).token_ids == (2,)
        ch.close()
        with pytest.raises(WorkerLost):
            await b.next()

    run(body)


def test_close_fails_the_requests_of_draining_subscriptions_too() -> None:
    async def body() -> None:
        actor = FakeDecodeActor()
        ch = DecodeChannel("d0", actor, "r", resubscribe_after=1)
        a = ch.open_request("a")
        actor.send([("a", chunk(1))])
        assert (await a.next()).token_ids == (1,)
        b = ch.open_request("b")
        assert ch.num_draining == 1
        ch.close("decode worker d0 left the cluster")
        await ch.wait_closed()
        for s in (a, b):
            with pytest.raises(WorkerLost, match="left the cluster"):
                await s.next()
        assert ch.num_open == 0 and ch.num_draining == 0

    run(body)


def test_a_stopped_subscription_lets_go_of_its_call_once_its_reader_ends() -> None:
    """Ray frees what it recorded of a streaming call's items (~0.5 MB a subscription) only
    when the generator is deleted: a finished reader (its CancelledError's traceback holds
    the generator) must not be kept by the channel, or every rotation and drain leaks one."""

    async def body() -> None:
        actor = FakeDecodeActor()
        ch = DecodeChannel("d0", actor, "r", resubscribe_after=1)
        for rid in ("a", "b", "c"):  # each request a fresh subscription; the last one stays
            stream = ch.open_request(rid)
            actor.send([(rid, chunk(1, finish=FinishReason.LENGTH))])
            await stream.next()
            stream.close()
        del stream  # (a closed request's stream still names its subscription)
        for _ in range(5):
            await asyncio.sleep(0)
        gc.collect()
        assert [ref() is None for ref in actor.calls] == [True, True, False]
        ch.close()
        await ch.wait_closed()
        for _ in range(200):  # the reader's done callback runs on a later turn of the loop
            gc.collect()
            if all(ref() is None for ref in actor.calls):
                break
            await asyncio.sleep(0.01)
        assert all(ref() is None for ref in actor.calls)

    run(body)
