"""A worker that switched role (the same actor, the same id) is taken as its new role from its
first load report that says so, or from the registry's listing unless its own later report
says otherwise: placement never sends it the old role's work once it reports itself draining,
nor the new role's before it reports ready in that role; a worker that no longer decodes
loses the router's token channel."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from router_fakes import Method, make_info, make_load

from router.cluster_view import ClusterView, StaticDirectory
from vocabulary.worker_api import WorkerLoad, WorkerRole, WorkerState


class Switching:
    """A worker actor whose load report the test sets (its role and state)."""

    def __init__(self, load: WorkerLoad) -> None:
        self.report = load
        self.load = Method(self._load)

    async def _load(self) -> WorkerLoad:
        return self.report


def ids(entries: list[Any]) -> list[str]:
    return [e.worker_id for e in entries]


def test_the_view_follows_a_role_switch_through_the_workers_load_reports() -> None:
    async def body() -> None:
        p1 = Switching(make_load("p1", WorkerRole.PREFILL))
        d0 = Switching(make_load("d0", WorkerRole.DECODE))
        directory = StaticDirectory(
            [(make_info("p1", WorkerRole.PREFILL), p1), (make_info("d0", WorkerRole.DECODE), d0)]
        )
        view = ClusterView(directory)
        await view.refresh_registry()
        await view.poll_loads()
        assert (ids(view.prefill_workers()), ids(view.decode_workers())) == (["p1"], ["d0"])
        # the drain begins: p1 is still a prefill worker, placed on by nobody
        p1.report = dataclasses.replace(p1.report, state=WorkerState.DRAINING)
        await view.poll_loads()
        assert (ids(view.prefill_workers()), ids(view.decode_workers())) == ([], ["d0"])
        # flipped, not admitting yet: decode now, still not placed on
        p1.report = dataclasses.replace(p1.report, role=WorkerRole.DECODE)
        await view.poll_loads()
        assert view.entries["p1"].info.role is WorkerRole.DECODE
        assert ids(view.decode_workers()) == ["d0"]
        # ready in its new role, before the registry says so
        p1.report = dataclasses.replace(p1.report, state=WorkerState.READY)
        await view.poll_loads()
        assert (ids(view.prefill_workers()), ids(view.decode_workers())) == ([], ["p1", "d0"])
        await view.refresh_registry()  # the registry still lists it as prefill: no step back
        assert view.entries["p1"].info.role is WorkerRole.DECODE

    asyncio.run(body())


def test_a_registry_listing_of_the_new_role_closes_the_channel_of_a_former_decode_worker() -> None:
    async def body() -> None:
        d0 = Switching(make_load("d0", WorkerRole.DECODE))
        info = make_info("d0", WorkerRole.DECODE)
        directory = StaticDirectory([(info, d0)])
        view = ClusterView(directory)
        await view.refresh_registry()
        entry = view.entries["d0"]
        channel = view.decode_channel(entry)
        directory.workers = [(dataclasses.replace(info, role=WorkerRole.PREFILL), d0)]
        await view.refresh_registry()
        assert view.entries["d0"] is entry and entry.info.role is WorkerRole.PREFILL
        assert entry.channel is None and channel.state.value == "closed"
        assert view.decode_channel(entry) is not channel  # a fresh one should it decode again

    asyncio.run(body())
