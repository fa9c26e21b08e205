"""A bounded wait delivers its caller's cancellation even when what it waits for completes in
the same loop turn. asyncio.wait_for on Python 3.11 returned the result instead and the
cancellation was lost: a client that left while its token stream delivered a chunk did not
abort its request, which decoded on to its end holding its KV blocks."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from router.errors import StageTimeout
from router.worker_calls import within
from vocabulary.waits import wait_within


def _router_within(aw: Awaitable[Any], timeout_s: float) -> Awaitable[Any]:
    return within(aw, timeout_s, None, "token stream", "decode-0", 3)


WAITS: list[Callable[[Awaitable[Any], float], Awaitable[Any]]] = [wait_within, _router_within]


@pytest.mark.parametrize("wait", WAITS, ids=["wait_within", "router.within"])
def test_a_cancel_in_the_turn_the_result_arrives_is_not_lost(
    wait: Callable[[Awaitable[Any], float], Awaitable[Any]],
) -> None:
    async def main() -> None:
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(wait(fut, 10.0))
        await asyncio.sleep(0)  # the task now waits on fut
        fut.set_result("chunk")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


@pytest.mark.parametrize("wait", WAITS, ids=["wait_within", "router.within"])
def test_a_result_in_time_is_returned_and_a_late_one_times_out(
    wait: Callable[[Awaitable[Any], float], Awaitable[Any]],
) -> None:
    async def main() -> None:
        assert await wait(asyncio.sleep(0, "ok"), 5.0) == "ok"
        never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        expected = StageTimeout if wait is _router_within else TimeoutError
        with pytest.raises(expected) as info:
            await wait(never, 0.05)
        assert never.cancelled()  # the wait cancels what it gave up on
        if wait is _router_within:
            assert "decode-0" in str(info.value) and "3 tokens delivered" in str(info.value)

    asyncio.run(main())
