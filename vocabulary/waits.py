"""Bounded waits that never lose a cancellation.

Every wait on another process in pdserve goes through `wait_within`, not `asyncio.wait_for`:
on Python 3.11, `wait_for` returns the result of an awaitable that completes in the same
loop turn in which its caller is cancelled, and the cancellation is gone (CPython gh-86296;
3.12 rebuilt `wait_for` on `asyncio.timeout`). A request whose client left then went on
decoding to its end, holding its KV blocks, because its token stream delivered a chunk just
as the HTTP layer cancelled it; a loop task cancelled on shutdown went on polling.
`asyncio.timeout` delivers the cancellation on every version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """`await aw`, cancelled and raising TimeoutError after `timeout_s` (None: no limit)."""
    async with asyncio.timeout(timeout_s):
        return await aw
