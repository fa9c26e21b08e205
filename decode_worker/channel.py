"""Token channels: how a decode worker sends many requests' tokens to one caller at once.

A caller (a router) keeps one channel per decode worker: one `subscribe(channel_id)` (a Ray
streaming call) and a `submit(request, channel_id)` per request. The engine thread hands its
outputs over once per step; each request's `RequestSink` keeps them on its channel, and the
subscription takes everything that piled up as one batch: a list of `(request_id,
TokenChunk)` (the request's outputs since its previous chunk, merged) and `ChunkError`s. So
the worker makes one Ray item per caller per engine step (or per wake-up of the subscriber,
when steps are faster than the caller reads), not one per request per step.

Channel states (`ChannelState`):

    DETACHED --attach--> ATTACHED --detach--> DETACHED    (a later subscription may attach)
    ATTACHED --attach--> ATTACHED                         (the newer subscription replaces
                                                           the older, which ends)
    DETACHED/ATTACHED --close--> CLOSED                   (worker shutdown, or an orphan
                                                           reaped by the worker: no
                                                           subscriber, or a lease not renewed)

A request's sink: open (outputs accumulate between batches) → terminal (its finishing
output arrived, or `end` gave it a last item: the ABORT chunk or a `ChunkError`) → gone
(a batch took its last item). Every request on a channel ends with exactly one terminal
item, and nothing follows it.

`ChannelRegistry` holds a worker's channels by id and closes the ones nobody reads (no
subscriber for a while, or a subscription lease not renewed), aborting their requests.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable

from vocabulary.decode_api import ChannelInfo, ChannelItem, ChunkError, TokenChunk
from vocabulary.engine_io import RequestOutput
from vocabulary.logprobs import TopLogprobs

log = logging.getLogger(__name__)


class ChannelState(enum.Enum):
    DETACHED = "detached"
    ATTACHED = "attached"
    CLOSED = "closed"


class RequestSink:
    """One request's outputs on its channel: the runtime's `OutputSink` for the request.

    `done` resolves once: to None when the finishing output arrives, or to the error the
    runtime delivers (abort, failed step, worker stop). Unless it finished, the request's
    pipeline then gives it its last item with `end`.
    """

    def __init__(self, channel: OutputChannel, request_id: str) -> None:
        self.channel = channel
        self.request_id = request_id
        self.done: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        self.num_transferred_tokens = 0
        """Reported on the first chunk (set by the pipeline before the request joins the
        batch)."""
        self.transfer_s = 0.0
        self.terminal = False
        self.queued = False
        """Waiting in the channel's ready list."""
        self._outputs: list[RequestOutput] = []
        self._last: ChannelItem | None = None
        self._first = True

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        if self.terminal:
            return
        if isinstance(item, BaseException):
            self._resolve(item)
            return
        self._outputs.append(item)
        if item.finish_reason is not None:
            self.terminal = True
            self._resolve(None)
        self.channel.ready(self)

    def end(self, last: TokenChunk | ChunkError) -> None:
        """Give the request its last item (after any tokens not yet taken)."""
        if self.terminal:
            return
        self.terminal = True
        self._last = last if isinstance(last, ChunkError) else (self.request_id, last)
        self._resolve(None)
        self.channel.ready(self)

    def take(self) -> list[ChannelItem]:
        items: list[ChannelItem] = []
        if self._outputs:
            chunk = merge_outputs(
                self._outputs, self._first, self.num_transferred_tokens, self.transfer_s
            )
            items.append((self.request_id, chunk))
            self._outputs = []
            self._first = False
        if self._last is not None:
            items.append(self._last)
            self._last = None
        return items

    def _resolve(self, error: BaseException | None) -> None:
        if not self.done.done():
            self.done.set_result(error)


class OutputChannel:
    """The requests of one caller on this worker, and what they produced since the last batch
    (see the module docstring for the states). Lives on the actor's event loop."""

    def __init__(self, channel_id: str) -> None:
        self.channel_id = channel_id
        self.state = ChannelState.DETACHED
        self.epoch = 0
        """Bumped by every `attach`: a subscription reads while the epoch is its own."""
        self.detached_at = time.monotonic()
        self.renewed_at = time.monotonic()
        """Last `renew` (subscriptions with a lease)."""
        self._open: set[RequestSink] = set()
        self._ready: list[RequestSink] = []
        self._wake = asyncio.Event()

    def adopt(self, sink: RequestSink) -> None:
        """The sink's request is now on this channel (until a batch takes its last item)."""
        self._open.add(sink)

    @property
    def open_requests(self) -> list[str]:
        return [s.request_id for s in self._open]

    def ready(self, sink: RequestSink) -> None:
        if not sink.queued:
            sink.queued = True
            self._ready.append(sink)
            self._wake.set()

    def take(self) -> list[ChannelItem]:
        """Everything that piled up since the last batch (requests whose last item it holds
        leave the channel)."""
        items: list[ChannelItem] = []
        ready, self._ready = self._ready, []
        for sink in ready:
            sink.queued = False
            items.extend(sink.take())
            if sink.terminal:
                self._open.discard(sink)
        return items

    async def next_batch(self, epoch: int) -> list[ChannelItem] | None:
        """The next non-empty batch, or None once this subscription is replaced, or the
        channel is closed and nothing is left to take."""
        while True:
            if self.epoch != epoch:
                return None
            if self._ready:
                items = self.take()
                if items:
                    return items
            if self.state is ChannelState.CLOSED:
                return None
            self._wake.clear()
            await self._wake.wait()

    def attach(self) -> int:
        """A subscription starts reading; returns its epoch (an older reader ends)."""
        self.epoch += 1
        self.state = ChannelState.ATTACHED
        self._wake.set()
        return self.epoch

    def renew(self) -> None:
        """The subscriber says it is alive (Ray does not end an actor's streaming call when
        its caller dies: a lease is how the worker learns of it)."""
        self.renewed_at = time.monotonic()

    def detach(self, epoch: int) -> bool:
        """The subscription of `epoch` ended; False if a newer one reads (or closed)."""
        if self.epoch != epoch or self.state is not ChannelState.ATTACHED:
            return False
        self.state = ChannelState.DETACHED
        self.detached_at = time.monotonic()
        return True

    def close(self) -> None:
        """No more subscriptions; a reader takes what is left and ends."""
        self.state = ChannelState.CLOSED
        self._wake.set()

    def info(self) -> ChannelInfo:
        return ChannelInfo(self.channel_id, self.state is ChannelState.ATTACHED, len(self._open))


class ChannelRegistry:
    """A worker's token channels by id, and the timers that close the ones nobody reads.

    A channel opens on its first `submit` or `subscribe`. It is forgotten when its
    subscription ends with no request open; closed, with its requests handed to `abort`,
    when it has had no subscriber for `orphan_s`, or when a subscription with a lease was
    not renewed within it (Ray keeps an actor's streaming call running after its caller
    died: the lease is how the worker learns that a router is gone). Loop thread only.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, abort: Callable[[str], object], orphan_s: float
    ) -> None:
        self._loop = loop
        self._abort = abort
        self.orphan_s = orphan_s
        self._channels: dict[str, OutputChannel] = {}

    def get(self, channel_id: str) -> OutputChannel:
        """The channel of that id (a new one if there is none, or it was closed)."""
        channel = self._channels.get(channel_id)
        if channel is None or channel.state is ChannelState.CLOSED:
            channel = OutputChannel(channel_id)
            self._channels[channel_id] = channel
            self._orphaned(channel)  # in case no subscription ever comes
        return channel

    def attach(self, channel: OutputChannel, lease_s: float | None) -> int:
        """A subscription starts reading `channel`; returns its epoch."""
        epoch = channel.attach()
        if lease_s is not None:
            channel.renew()
            self._watch_lease(channel, epoch, lease_s)
        return epoch

    def detach(self, channel: OutputChannel, epoch: int) -> None:
        """The subscription of `epoch` ended."""
        if channel.detach(epoch):
            self._orphaned(channel)

    def renew(self, channel_id: str) -> bool:
        channel = self._channels.get(channel_id)
        if channel is None:
            return False
        channel.renew()
        return True

    def infos(self) -> list[ChannelInfo]:
        return [c.info() for c in self._channels.values()]

    def close_all(self) -> None:
        for channel in list(self._channels.values()):
            self._forget(channel)

    def _orphaned(self, channel: OutputChannel) -> None:
        """No subscriber: forget the channel now if it holds no request, else give a
        subscriber `orphan_s` to come (back) before its requests are aborted."""
        if not channel.open_requests and channel.epoch > 0:
            self._forget(channel)
            return
        self._loop.call_later(self.orphan_s, self._reap, channel, channel.epoch)

    def _reap(self, channel: OutputChannel, epoch: int) -> None:
        if channel.epoch != epoch or channel.state is not ChannelState.DETACHED:
            return  # a subscription came (back), or it was closed already
        self._close_orphan(channel, f"no subscriber for {self.orphan_s:.0f} s")

    def _watch_lease(self, channel: OutputChannel, epoch: int, lease_s: float) -> None:
        def check() -> None:
            if channel.epoch != epoch or channel.state is not ChannelState.ATTACHED:
                return  # replaced, detached (the orphan timer runs) or closed
            quiet = time.monotonic() - channel.renewed_at
            if quiet < lease_s:
                self._loop.call_later(lease_s - quiet, check)
                return
            self._close_orphan(channel, f"lease not renewed for {quiet:.1f} s")

        self._loop.call_later(lease_s, check)

    def _close_orphan(self, channel: OutputChannel, why: str) -> None:
        """Nobody reads the channel: close it (a subscriber still attached takes what is
        left and ends) and abort its requests."""
        orphans = channel.open_requests
        if orphans:
            log.warning(
                "token channel %s: %s; closing it and aborting its %d requests",
                channel.channel_id, why, len(orphans),
            )  # fmt: skip
        self._forget(channel)
        for rid in orphans:
            self._abort(rid)

    def _forget(self, channel: OutputChannel) -> None:
        channel.close()
        if self._channels.get(channel.channel_id) is channel:
            del self._channels[channel.channel_id]


def merge_outputs(
    outs: list[RequestOutput], first: bool, transferred: int, transfer_s: float
) -> TokenChunk:
    """One chunk for the outputs a request produced since its previous chunk; the first chunk
    reports the transfer and (local prefill) the queue and prefill times."""
    last = outs[-1]
    logprobs: tuple[float, ...] | None = None
    if any(o.logprobs is not None for o in outs):
        logprobs = tuple(lp for o in outs for lp in (o.logprobs or ()))
    top: tuple[TopLogprobs, ...] | None = None
    if any(o.top_logprobs is not None for o in outs):
        top = tuple(t for o in outs for t in (o.top_logprobs or ()))
    t = last.timings
    scheduled = t.first_scheduled or t.arrival
    return TokenChunk(
        token_ids=tuple(tok for o in outs for tok in o.new_token_ids),
        text="".join(o.text_delta for o in outs),
        logprobs=logprobs,
        top_logprobs=top,
        prompt_logprobs=next((o.prompt_logprobs for o in outs if o.prompt_logprobs), None),
        finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_prompt_tokens=last.num_cached_prompt_tokens,
        num_transferred_tokens=transferred if first else 0,
        transfer_s=transfer_s if first else 0.0,
        queue_s=max(scheduled - t.arrival, 0.0) if first else 0.0,
        prefill_s=max((t.first_token or scheduled) - scheduled, 0.0) if first else 0.0,
    )
