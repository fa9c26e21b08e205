"""The router's token channel to one decode worker: one subscription carries the tokens of all
of this router's requests there, one Ray item per engine step (decode_worker/channel.py).

`open_request` registers a request's queue (before the worker could send anything for it)
and `RequestStream.submit` hands the request to the worker; the reader task takes each batch
off the subscription and puts every item on its request's queue. Items of requests no longer
registered (closed, aborted) are dropped. The subscription holds a lease of `lease_s` on the
worker, renewed every quarter of it while the channel is open: if this router dies, the
worker closes the channel and aborts its requests once the lease runs out (Ray itself keeps
an actor's streaming call running after its caller is gone).

States (`ChannelState`):

    IDLE --open_request--> OPEN          (subscribes under a fresh channel id, starts the reader)
    OPEN --subscription ends or fails--> BROKEN   (every open request gets a WorkerLost; an
                                                   actor death also marks the worker dead)
    BROKEN --open_request--> OPEN        (subscribes again, under a new id)
    any --close--> CLOSED                (the worker left the registry, or the router stops;
                                          open requests get a WorkerLost)
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
from collections.abc import Callable
from typing import Any

from decode_worker.api import ChannelItem, ChunkError, DecodeRequest, TokenChunk
from router.errors import WorkerLost, is_actor_death, unwrap
from router.worker_calls import cancel_remote

log = logging.getLogger(__name__)

CHANNEL_LEASE_S = 10.0
"""How long a decode worker keeps this router's channel without hearing from it."""


class ChannelState(enum.Enum):
    IDLE = "idle"
    OPEN = "open"
    BROKEN = "broken"
    CLOSED = "closed"


class RequestStream:
    """One request's chunks from its decode worker (what the orchestrator reads)."""

    def __init__(self, channel: DecodeChannel, request_id: str) -> None:
        self.channel = channel
        self.request_id = request_id
        self._queue: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        self._closed = False

    async def submit(self, req: DecodeRequest) -> None:
        """Hand the request to the worker; raises what the worker refused it with."""
        await self.channel.handle.submit.remote(req, self.channel.channel_id)

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


class DecodeChannel:
    """This router's requests on one decode worker (see the module docstring)."""

    def __init__(
        self,
        worker_id: str,
        handle: Any,
        id_prefix: str,
        on_worker_death: Callable[[], None] | None = None,
        lease_s: float = CHANNEL_LEASE_S,
    ) -> None:
        self.worker_id = worker_id
        self.handle = handle
        self.state = ChannelState.IDLE
        self.channel_id = ""
        self._id_prefix = f"{id_prefix}/{worker_id}/"
        self._seq = itertools.count()
        self._on_worker_death = on_worker_death
        self._streams: dict[str, RequestStream] = {}
        self.lease_s = lease_s
        self._reader: asyncio.Task[None] | None = None
        self._renewer: asyncio.Task[None] | None = None
        self._subscription: Any = None
        self.num_batches = 0
        """Batches received so far (over every subscription)."""

    @property
    def num_open(self) -> int:
        return len(self._streams)

    def open_request(self, request_id: str) -> RequestStream:
        """Register a request (subscribing first if needed); submit it with the stream."""
        if self.state is ChannelState.CLOSED:
            raise WorkerLost(f"decode worker {self.worker_id} left the cluster")
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already open on this channel")
        if self.state is not ChannelState.OPEN:
            self._subscribe()
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        return stream

    def release(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    def close(self, reason: str = "") -> None:
        """End the subscription; open requests fail with WorkerLost."""
        if self.state is ChannelState.CLOSED:
            return
        self.state = ChannelState.CLOSED
        self._stop_reader()
        self._fail_all(reason or f"decode worker {self.worker_id}: token channel closed")

    async def wait_closed(self) -> None:
        """After `close`: wait until the reader and renewal tasks have ended."""
        for task in (self._reader, self._renewer):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # ---- the subscription -------------------------------------------------------------------

    def _subscribe(self) -> None:
        self._stop_reader()
        self.channel_id = f"{self._id_prefix}{next(self._seq)}"
        gen = self.handle.subscribe.options(num_returns="streaming").remote(
            self.channel_id, self.lease_s
        )
        self._subscription = gen
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read(gen), name=f"token-channel-{self.channel_id}")
        self._renewer = loop.create_task(self._renew(self.channel_id))
        self.state = ChannelState.OPEN

    async def _renew(self, channel_id: str) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 4)
            # Fire and forget: a worker that is gone fails the subscription, not this.
            self.handle.renew.remote(channel_id)

    def _stop_reader(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        if self._subscription is not None:
            cancel_remote(self._subscription)
            self._subscription = None

    async def _read(self, subscription: Any) -> None:
        try:
            async for ref in subscription:
                batch: list[ChannelItem] = await ref
                self.num_batches += 1
                self._route(batch)
            reason = f"decode worker {self.worker_id} ended token channel {self.channel_id}"
        except asyncio.CancelledError:
            raise  # closed, or replaced by a new subscription: whoever cancelled handles it
        except Exception as e:
            cause = unwrap(e)
            if is_actor_death(cause) and self._on_worker_death is not None:
                self._on_worker_death()
            reason = f"decode worker {self.worker_id} lost: {type(cause).__name__}: {cause}"
        if self._subscription is subscription:  # still ours: nobody closed or replaced it
            log.warning("%s; failing its %d open requests", reason, len(self._streams))
            self._subscription = None
            if self._renewer is not None:
                self._renewer.cancel()
            self.state = ChannelState.BROKEN
            self._fail_all(reason)

    def _route(self, batch: list[ChannelItem]) -> None:
        streams = self._streams
        for item in batch:
            if isinstance(item, ChunkError):
                stream = streams.get(item.request_id)
                if stream is not None:
                    stream.put(item.error)
            else:
                stream = streams.get(item[0])
                if stream is not None:
                    stream.put(item[1])

    def _fail_all(self, reason: str) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(WorkerLost(reason))
