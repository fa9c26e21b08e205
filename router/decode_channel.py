"""The router's token channel to one decode worker: one subscription carries the tokens of all
of this router's requests there, one Ray item per engine step (decode_worker/channel.py).

`open_request` registers a request's queue (before the worker could send anything for it)
and `RequestStream.submit` hands the request to the worker; the reader task takes each batch
off the subscription and puts every item on its request's queue. Items of requests no longer
registered (closed, aborted) are dropped. The subscription holds a lease of `lease_s` on the
worker, renewed every quarter of it while the channel is open: if this router dies, the
worker closes the channel and aborts its requests once the lease runs out (Ray itself keeps
an actor's streaming call running after its caller is gone).

A subscription is not kept forever: once it has carried `resubscribe_after` batches, the
next request opens a fresh one (under a new channel id) and the old one drains, serving the
requests it holds until the last of them ends, and is then cancelled. Each request stays on
the subscription it was opened on. Why: Ray keeps a record of every item a streaming call
has yielded until the call ends, on both sides (the caller's ObjectRefStream keeps each
item's id in a hash set, the executing worker each item's id in a vector; ~40 bytes an item
each), so one subscription for the life of the cluster grew the router's and the decode
worker's memory by tens of MB an hour under load (docs/benchmarks.md, "Chaos and soak"), and
Ray fails a streaming call past 1e8 items.

States (`ChannelState`):

    IDLE --open_request--> OPEN          (subscribes under a fresh channel id, starts the reader)
    OPEN --open_request, `resubscribe_after` batches read--> OPEN   (a fresh subscription for
                                          new requests; the old one drains)
    OPEN --subscription ends or fails--> BROKEN   (every request open on it gets a WorkerLost;
                                                   an actor death also marks the worker dead)
    BROKEN --open_request--> OPEN        (subscribes again, under a new id)
    any --close--> CLOSED                (the worker left the registry, or the router stops;
                                          open requests get a WorkerLost)

A draining subscription that ends or fails gives its own requests a WorkerLost (an actor
death also marks the worker dead) and leaves the channel's state as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
from collections.abc import Callable
from typing import Any

from router.errors import WorkerLost, is_actor_death, unwrap
from router.worker_calls import cancel_remote
from vocabulary.decode_api import ChannelItem, ChunkError, DecodeRequest, TokenChunk

log = logging.getLogger(__name__)

CHANNEL_LEASE_S = 10.0
"""How long a decode worker keeps this router's channel without hearing from it."""

RESUBSCRIBE_AFTER = 10_000
"""Batches one subscription carries before new requests go to a fresh one (see the module
docstring): Ray's record of a subscription's items stays under ~0.5 MB on each side, and a
fresh subscription (one Ray call) every 10,000 engine steps costs nothing measurable."""


class ChannelState(enum.Enum):
    IDLE = "idle"
    OPEN = "open"
    BROKEN = "broken"
    CLOSED = "closed"


class RequestStream:
    """One request's chunks from its decode worker (what the orchestrator reads)."""

    def __init__(self, channel: DecodeChannel, subscription: Subscription, request_id: str) -> None:
        self.channel = channel
        self.subscription = subscription
        self.request_id = request_id
        self._queue: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        self._closed = False

    async def submit(self, req: DecodeRequest) -> None:
        """Hand the request to the worker; raises what the worker refused it with."""
        await self.channel.handle.submit.remote(req, self.subscription.channel_id)

    async def next(self) -> TokenChunk:
        """The request's next chunk; raises its error (the worker's, or WorkerLost)."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def put(self, item: TokenChunk | BaseException) -> None:
        self._queue.put_nowait(item)

    def close(self) -> None:
        """Stop receiving (idempotent); chunks that still come are dropped."""
        if not self._closed:
            self._closed = True
            self.channel.release(self)


class Subscription:
    """One `subscribe` call on the decode worker (under its own channel id), the requests
    opened on it, and the tasks that read it and renew its lease."""

    def __init__(self, channel_id: str, call: Any) -> None:
        self.channel_id = channel_id
        self.call = call
        """The Ray streaming call (an ObjectRefGenerator)."""
        self.streams: dict[str, RequestStream] = {}
        self.num_batches = 0
        self.reader: asyncio.Task[None] | None = None
        self.renewer: asyncio.Task[None] | None = None

    def stop(self) -> None:
        """Cancel the reader, the renewals and the call (idempotent)."""
        for task in (self.renewer, self.reader):
            if task is not None and not task.done():
                task.cancel()
        cancel_remote(self.call)


class DecodeChannel:
    """This router's requests on one decode worker (see the module docstring)."""

    def __init__(
        self,
        worker_id: str,
        handle: Any,
        id_prefix: str,
        on_worker_death: Callable[[], None] | None = None,
        lease_s: float = CHANNEL_LEASE_S,
        resubscribe_after: int = RESUBSCRIBE_AFTER,
    ) -> None:
        self.worker_id = worker_id
        self.handle = handle
        self.state = ChannelState.IDLE
        self.channel_id = ""
        """The id of the latest subscription (the one new requests open on while OPEN)."""
        self._id_prefix = f"{id_prefix}/{worker_id}/"
        self._seq = itertools.count()
        self._on_worker_death = on_worker_death
        self.lease_s = lease_s
        self.resubscribe_after = resubscribe_after
        self._current: Subscription | None = None
        """The subscription new requests open on (None: idle, broken or closed)."""
        self._draining: list[Subscription] = []
        """Older subscriptions, until their last request ends."""
        self._stopped: set[asyncio.Task[None]] = set()
        """Tasks of stopped subscriptions still finishing (`wait_closed`); each leaves the set
        as it ends, so that nothing keeps a finished reader: its CancelledError's traceback
        holds the subscription's Ray generator, and Ray frees what it recorded of the call's
        items (~0.5 MB) only once that generator is deleted."""
        self.num_batches = 0
        """Batches received so far (over every subscription)."""
        self.num_subscriptions = 0
        """Subscriptions made so far (the first, rotations, and after each break)."""

    @property
    def num_open(self) -> int:
        return sum(len(sub.streams) for sub in self._subscriptions())

    @property
    def num_draining(self) -> int:
        """Older subscriptions still serving the requests opened on them."""
        return len(self._draining)

    def open_request(self, request_id: str) -> RequestStream:
        """Register a request (subscribing first if needed); submit it with the stream."""
        if self.state is ChannelState.CLOSED:
            raise WorkerLost(f"decode worker {self.worker_id} left the cluster")
        if any(request_id in sub.streams for sub in self._subscriptions()):
            raise ValueError(f"request_id: {request_id!r} is already open on this channel")
        sub = self._current
        if sub is None or self.state is not ChannelState.OPEN:
            sub = self._subscribe()
        elif sub.num_batches >= self.resubscribe_after:
            self._retire(sub)
            sub = self._subscribe()
        stream = RequestStream(self, sub, request_id)
        sub.streams[request_id] = stream
        return stream

    def release(self, stream: RequestStream) -> None:
        sub = stream.subscription
        if sub.streams.get(stream.request_id) is stream:
            del sub.streams[stream.request_id]
            if not sub.streams and sub in self._draining:
                self._draining.remove(sub)
                self._stop(sub)

    def close(self, reason: str = "") -> None:
        """End the subscriptions; open requests fail with WorkerLost."""
        if self.state is ChannelState.CLOSED:
            return
        self.state = ChannelState.CLOSED
        subs = self._subscriptions()
        self._current, self._draining = None, []
        for sub in subs:
            self._stop(sub)
            self._fail(sub, reason or f"decode worker {self.worker_id}: token channel closed")

    async def wait_closed(self) -> None:
        """After `close`: wait until the readers and renewal tasks have ended."""
        for task in list(self._stopped):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ---- the subscriptions ------------------------------------------------------------------

    def _subscriptions(self) -> list[Subscription]:
        current = [self._current] if self._current is not None else []
        return current + self._draining

    def _subscribe(self) -> Subscription:
        """A fresh subscription for new requests (an old current one is stopped: broken)."""
        if self._current is not None:
            self._stop(self._current)
        channel_id = f"{self._id_prefix}{next(self._seq)}"
        self.channel_id = channel_id
        call = self.handle.subscribe.options(num_returns="streaming").remote(
            channel_id, self.lease_s
        )
        sub = Subscription(channel_id, call)
        loop = asyncio.get_running_loop()
        sub.reader = loop.create_task(self._read(sub), name=f"token-channel-{channel_id}")
        sub.renewer = loop.create_task(self._renew(channel_id))
        self._current = sub
        self.num_subscriptions += 1
        self.state = ChannelState.OPEN
        return sub

    def _retire(self, sub: Subscription) -> None:
        """`sub` takes no new requests: it drains (or stops now, holding none)."""
        self._current = None
        if sub.streams:
            self._draining.append(sub)
        else:
            self._stop(sub)

    def _stop(self, sub: Subscription) -> None:
        sub.stop()
        for task in (sub.reader, sub.renewer):
            if task is not None and not task.done():
                self._stopped.add(task)
                task.add_done_callback(self._stopped.discard)
        sub.reader = sub.renewer = None  # no cycle: subscription -> reader -> its traceback

    async def _renew(self, channel_id: str) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 4)
            # Fire and forget: a worker that is gone fails the subscription, not this.
            self.handle.renew.remote(channel_id)

    async def _read(self, sub: Subscription) -> None:
        try:
            async for ref in sub.call:
                batch: list[ChannelItem] = await ref
                sub.num_batches += 1
                self.num_batches += 1
                self._route(sub.streams, batch)
            reason = f"decode worker {self.worker_id} ended token channel {sub.channel_id}"
        except asyncio.CancelledError:
            raise  # stopped: whoever stopped it handles its requests
        except Exception as e:
            cause = unwrap(e)
            if is_actor_death(cause) and self._on_worker_death is not None:
                self._on_worker_death()
            reason = f"decode worker {self.worker_id} lost: {type(cause).__name__}: {cause}"
        if sub.renewer is not None:
            sub.renewer.cancel()
        if sub is self._current:  # nobody closed or replaced it
            log.warning("%s; failing its %d open requests", reason, len(sub.streams))
            self._current = None
            self.state = ChannelState.BROKEN
            self._fail(sub, reason)
        elif sub in self._draining:
            log.warning("%s (draining); failing its %d open requests", reason, len(sub.streams))
            self._draining.remove(sub)
            self._fail(sub, reason)

    @staticmethod
    def _route(streams: dict[str, RequestStream], batch: list[ChannelItem]) -> None:
        for item in batch:
            if isinstance(item, ChunkError):
                stream = streams.get(item.request_id)
                if stream is not None:
                    stream.put(item.error)
            else:
                stream = streams.get(item[0])
                if stream is not None:
                    stream.put(item[1])

    @staticmethod
    def _fail(sub: Subscription, reason: str) -> None:
        streams, sub.streams = sub.streams, {}
        for stream in streams.values():
            stream.put(WorkerLost(reason))
