"""A load poll sent before a decode worker's death but answered after its channel saw the
death must not put the worker back into placement."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from ray.exceptions import RayActorError

from prefix_index.types import PrefixMatch
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


class Reporter:
    """A worker whose load report shows its used blocks, running requests and queued prompt
    tokens as of when the report was asked for, answered when `answer` is set."""

    def __init__(self, info: WorkerInfo) -> None:
        self.info = info
        self.used_blocks = 0
        self.running = 0
        self.queued = 0
        self.answer: asyncio.Future[None] | None = None
        self.load = _Method(self._load)

    def _load(self) -> Any:
        fields = {f.name: 0 for f in dataclasses.fields(EngineLoad)}
        fields.update(num_total_blocks=512, num_free_blocks=512 - self.used_blocks,
                      num_running=self.running,
                      num_waiting_prefill_tokens=self.queued)  # fmt: skip
        asked = EngineLoad(**fields)  # the worker's state when the call reached it
        answer = self.answer

        async def report() -> WorkerLoad:
            if answer is not None:
                await answer
            return WorkerLoad(self.info.worker_id, self.info.role, WorkerState.READY, asked,
                              0, 0)  # fmt: skip

        return report()


def test_a_started_request_counts_until_a_report_asked_for_after_its_start_answers() -> None:
    """A request's blocks count on its decode worker from placement (reserved) through its
    first chunk (started) until a load report asked for after that answers: the report asked
    for before the start does not show it, and one asked for after does, once."""
    info = WorkerInfo("d0", WorkerRole.DECODE, "a", "n", "cpu", "tiny", 16, 512, 512, 64)

    async def body() -> list[tuple[int, int]]:
        worker = Reporter(info)
        view = ClusterView(StaticDirectory([(info, worker)]))
        await view.refresh_registry()
        await view.poll_loads()
        entry = view.entries["d0"]

        def seen() -> tuple[int, int]:
            (cand,) = view.decode_candidates(PrefixMatch(0))
            return cand.active_kv_blocks, cand.running_requests

        out = [seen()]
        reservation = view.reserve_decode("d0", 8)
        out.append(seen())  # reserved
        worker.answer = asyncio.get_running_loop().create_future()
        before = asyncio.create_task(view.poll_loads())  # asked for before the start
        await asyncio.sleep(0)
        worker.used_blocks, worker.running = 8, 1  # the worker runs it
        reservation.started()  # its first chunk
        reservation.release()  # the attempt's exit: a no-op after started
        worker.answer.set_result(None)
        await before
        out.append(seen())  # that report does not show it: still counted once
        worker.answer = None
        await view.poll_loads()  # asked for after the start
        out.append(seen())  # the report shows it; nothing added on top
        assert not entry.started_decode
        failed = view.reserve_decode("d0", 4)
        failed.release()  # never ran: nothing left counted
        out.append(seen())
        return out

    assert asyncio.run(body()) == [(0, 0), (8, 1), (8, 1), (8, 1), (8, 1)]


def test_a_prompt_sent_while_a_poll_is_out_counts_until_a_later_report_or_its_prefill_ends() -> (
    None
):
    info = WorkerInfo("p0", WorkerRole.PREFILL, "a", "n", "cpu", "tiny", 16, 512, 512, 64)

    async def body() -> list[int]:
        worker = Reporter(info)
        view = ClusterView(StaticDirectory([(info, worker)]))
        await view.refresh_registry()
        await view.poll_loads()
        entry = view.entries["p0"]
        out = [entry.queued_prefill_tokens]
        worker.answer = asyncio.get_running_loop().create_future()
        before = asyncio.create_task(view.poll_loads())  # asked for before the send
        await asyncio.sleep(0)
        first = entry.dispatch(300)  # sent while the poll is out
        worker.queued = 300  # it reaches the worker
        worker.answer.set_result(None)
        await before
        out.append(entry.queued_prefill_tokens)  # that report does not show it: still counted
        worker.answer = None
        await view.poll_loads()  # asked for after the send: shows it, nothing added on top
        out.append(entry.queued_prefill_tokens)
        second = entry.dispatch(100)
        out.append(entry.queued_prefill_tokens)
        entry.undispatch(second)  # its prefill ended before any report
        entry.undispatch(first)  # already dropped by the report: a no-op
        out.append(entry.queued_prefill_tokens)
        return out

    assert asyncio.run(body()) == [0, 300, 300, 400, 300]
