"""The decode worker's handshake locks (decode_worker/peer_locks.py): one per peer, requests of
one peer take turns, and no lock outlives its last holder or waiter (a long-running worker
meets a new prefill peer for every replaced prefill worker)."""

from __future__ import annotations

import asyncio

import pytest

from decode_worker.peer_locks import PeerLocks


def test_requests_of_one_peer_take_turns_and_the_lock_goes_with_the_last() -> None:
    async def run() -> tuple[list[str], int, int]:
        locks = PeerLocks()
        order: list[str] = []
        release = asyncio.Event()

        async def first() -> None:
            async with locks.hold("prefill-a"):
                order.append("first in")
                await release.wait()
                order.append("first out")

        async def second() -> None:
            async with locks.hold("prefill-a"):
                order.append("second in")

        async def other_peer() -> None:
            async with locks.hold("prefill-b"):
                order.append("other peer in")

        t1 = asyncio.create_task(first())
        await asyncio.sleep(0)
        t2 = asyncio.create_task(second())
        await other_peer()  # another peer's lock does not wait for prefill-a's
        await asyncio.sleep(0)
        during = len(locks)  # prefill-a held by first, waited for by second
        release.set()
        await asyncio.gather(t1, t2)
        return order, during, len(locks)

    order, during, after = asyncio.run(run())
    assert order == ["first in", "other peer in", "first out", "second in"]
    assert (during, after) == (1, 0)


def test_a_waiter_cancelled_while_waiting_leaves_no_lock_behind() -> None:
    async def run() -> int:
        locks = PeerLocks()
        held = asyncio.Event()
        release = asyncio.Event()

        async def holder() -> None:
            async with locks.hold("prefill-a"):
                held.set()
                await release.wait()

        async def waiter() -> None:
            async with locks.hold("prefill-a"):
                raise AssertionError("a cancelled waiter never gets the lock")

        h = asyncio.create_task(holder())
        await held.wait()
        w = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        w.cancel()
        with pytest.raises(asyncio.CancelledError):
            await w
        release.set()
        await h
        return len(locks)

    assert asyncio.run(run()) == 0


def test_a_holder_that_raises_frees_the_peer_for_the_next() -> None:
    async def run() -> int:
        locks = PeerLocks()
        with pytest.raises(RuntimeError):
            async with locks.hold("prefill-a"):
                raise RuntimeError("handshake failed")
        async with locks.hold("prefill-a"):
            pass
        return len(locks)

    assert asyncio.run(run()) == 0
