"""The router's view of the controller's registry (router/cluster_view.py
`ControllerDirectory`): one call per refresh that carries the signature of the listing the
router holds; the workers and their actor handles come back only when the registry changed."""

from __future__ import annotations

import asyncio

import pytest
from actor_fakes import AsyncMethod as _Method

from router.cluster_view import ControllerDirectory, RegistrySignature, WorkerListing


class FakeController:
    """`list_workers_if_changed` over a dict of worker id -> (start time, handle), counting
    the calls and the listings it sent."""

    def __init__(self) -> None:
        self.workers: dict[str, tuple[float, object]] = {}
        self.calls = 0
        self.listings = 0
        self.list_workers_if_changed = _Method(self._if_changed)

    def _if_changed(self, known: RegistrySignature | None) -> WorkerListing | None:
        self.calls += 1
        signature = tuple((wid, t) for wid, (t, _) in self.workers.items())
        if signature == known:
            return None
        self.listings += 1
        return WorkerListing(signature, tuple((wid, h) for wid, (_, h) in self.workers.items()))  # type: ignore[misc]


def test_handles_come_back_only_when_the_registry_changed() -> None:
    async def body() -> None:
        controller = FakeController()
        directory = ControllerDirectory(controller)
        a, b, a2 = object(), object(), object()
        assert await directory.list_workers() == []  # an empty registry is a listing too
        controller.workers["d0"] = (1.0, a)
        assert await directory.list_workers() == [("d0", a)]
        for _ in range(5):  # unchanged: no handles sent
            assert await directory.list_workers() == [("d0", a)]
        assert (controller.calls, controller.listings) == (7, 2)
        controller.workers["p0"] = (2.0, b)  # a worker joins
        assert await directory.list_workers() == [("d0", a), ("p0", b)]
        controller.workers["d0"] = (3.0, a2)  # replaced under the same id: a new incarnation
        assert await directory.list_workers() == [("d0", a2), ("p0", b)]
        del controller.workers["p0"]  # one leaves
        assert await directory.list_workers() == [("d0", a2)]
        assert await directory.list_workers() == [("d0", a2)]
        assert (controller.calls, controller.listings) == (11, 5)

    asyncio.run(body())


def test_a_failed_call_keeps_the_listing_and_the_next_one_catches_up() -> None:
    async def body() -> None:
        controller = FakeController()
        directory = ControllerDirectory(controller)
        a, b = object(), object()
        controller.workers["d0"] = (1.0, a)
        assert await directory.list_workers() == [("d0", a)]
        answer = controller.list_workers_if_changed

        def unreachable(known: RegistrySignature | None) -> WorkerListing | None:
            raise TimeoutError("controller busy")

        controller.list_workers_if_changed = _Method(unreachable)
        controller.workers["d1"] = (2.0, b)
        with pytest.raises(TimeoutError):  # ClusterView logs it and keeps its entries
            await directory.list_workers()
        controller.list_workers_if_changed = answer
        assert await directory.list_workers() == [("d0", a), ("d1", b)]

    asyncio.run(body())
