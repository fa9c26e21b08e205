"""Drive a decode worker's token channel the way the router does: one subscription per
caller, requests submitted on it, every batch read and sorted by request (with a timeout on
every wait)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import ray
from pd_client import CALL_TIMEOUT_S

from vocabulary.decode_api import ChannelItem, ChunkError, DecodeRequest, TokenChunk

Item = TokenChunk | ChunkError


def request_of(item: ChannelItem) -> str:
    return item.request_id if isinstance(item, ChunkError) else item[0]


def is_last(item: Item) -> bool:
    return isinstance(item, ChunkError) or item.finish_reason is not None


class ChannelReader:
    """Subscribes to channel `channel_id` of decode worker `d` and keeps everything it
    receives: the batches as they came, and each request's items in order."""

    def __init__(self, d: Any, channel_id: str) -> None:
        self.d = d
        self.channel_id = channel_id
        self.batches: list[list[ChannelItem]] = []
        self.items: dict[str, list[Item]] = defaultdict(list)
        self.seq: list[tuple[str, Item]] = []
        """Every item in arrival order (across requests)."""
        self.error: BaseException | None = None
        self._changed = asyncio.Event()
        self._subscription = d.subscribe.options(num_returns="streaming").remote(channel_id)
        self._task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            async for ref in self._subscription:
                batch: list[ChannelItem] = await ref
                self.batches.append(batch)
                for item in batch:
                    rid = request_of(item)
                    value: Item = item if isinstance(item, ChunkError) else item[1]
                    self.items[rid].append(value)
                    self.seq.append((rid, value))
                self._changed.set()
        except Exception as e:
            self.error = e
            self._changed.set()

    async def submit(self, req: DecodeRequest) -> None:
        await asyncio.wait_for(self.d.submit.remote(req, self.channel_id), CALL_TIMEOUT_S)

    def ended(self, rid: str) -> bool:
        got = self.items.get(rid)
        return bool(got) and is_last(got[-1])

    async def wait(
        self, predicate: Callable[[], bool], what: str, timeout_s: float = CALL_TIMEOUT_S
    ) -> None:
        """Until `predicate()` holds; raises the subscription's error, or TimeoutError."""

        async def until() -> None:
            while not predicate():
                if self.error is not None:
                    raise self.error
                self._changed.clear()
                await self._changed.wait()

        try:
            await asyncio.wait_for(until(), timeout_s)
        except TimeoutError:
            raise AssertionError(f"{what} not within {timeout_s}s") from None

    async def wait_ended(self, rids: list[str], timeout_s: float = CALL_TIMEOUT_S) -> None:
        await self.wait(lambda: all(self.ended(r) for r in rids), "every request ended", timeout_s)

    def tokens(self, rid: str) -> list[int]:
        return [t for c in self.items[rid] if isinstance(c, TokenChunk) for t in c.token_ids]

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            ray.cancel(self._subscription)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def engine_blocks(actor: Any) -> tuple[int, dict[str, int]]:
    """Taken at one point on the worker's engine thread: KV blocks in use (not allocatable),
    and the blocks each request in the engine holds."""

    def probe(worker: Any) -> tuple[int, dict[str, int]]:
        def on_engine(engine: Any) -> tuple[int, dict[str, int]]:
            held = {rid: len(r.block_ids) for rid, r in engine.scheduler.requests.items()}
            load = engine.load()
            return load.num_total_blocks - load.num_free_blocks, held

        return worker.runtime.driver.call(on_engine).result(timeout=30)

    return ray.get(actor.__ray_call__.remote(probe), timeout=CALL_TIMEOUT_S)
