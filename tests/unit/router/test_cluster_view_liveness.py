"""A load poll sent before a decode worker's death but answered after its channel saw the
death must not put the worker back into placement."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from ray.exceptions import RayActorError

from router.cluster_view import ClusterView, StaticDirectory
from router.errors import WorkerLost
from vocabulary.engine_io import EngineLoad
from vocabulary.worker_api import WorkerInfo, WorkerLoad, WorkerRole, WorkerState


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def options(self, **_: Any) -> _Method:
        return self

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class Victim:
    """A decode actor: its subscription dies (RayActorError) while a load call is in flight."""

    def __init__(self, info: WorkerInfo) -> None:
        self.info = info
        self.in_flight: asyncio.Future[None] | None = None
        self.feed: asyncio.Queue[BaseException] = asyncio.Queue()
        self.load = _Method(self._load)
        self.subscribe = _Method(self._subscribe)
        self.renew = _Method(lambda cid: None)

    async def _load(self) -> WorkerLoad:
        if self.in_flight is not None:
            await self.in_flight  # the answer was sent before the death, arrives after it
        return WorkerLoad(
            self.info.worker_id,
            WorkerRole.DECODE,
            WorkerState.READY,
            EngineLoad(*([0] * len(dataclasses.fields(EngineLoad)))),
            0,
            0,
        )

    def _subscribe(self, channel_id: str, lease_s: float) -> Any:
        async def stream() -> Any:
            raise await self.feed.get()
            yield  # pragma: no cover

        return stream()


def test_a_poll_answered_after_the_channel_saw_the_death_does_not_revive_the_worker() -> None:
    info = WorkerInfo("d0", WorkerRole.DECODE, "a", "n", "cpu", "tiny", 16, 512, 512, 64)

    async def body() -> bool:
        victim = Victim(info)
        view = ClusterView(StaticDirectory([(info, victim)]))
        await view.refresh_registry()
        await view.poll_loads()
        entry = view.entries["d0"]
        assert entry.serving
        stream = view.decode_channel(entry).open_request("r")
        victim.in_flight = asyncio.get_running_loop().create_future()
        poll = asyncio.create_task(view.poll_loads())
        await asyncio.sleep(0)
        victim.feed.put_nowait(RayActorError())  # the channel breaks: the actor died
        with pytest.raises(WorkerLost):
            await stream.next()
        assert not entry.alive
        victim.in_flight.set_result(None)
        await poll
        return entry.alive

    assert asyncio.run(body()) is False
