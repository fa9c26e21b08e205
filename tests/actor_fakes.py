"""A Ray actor method's stand-in for unit tests of the code that calls it: `AsyncMethod(fn)` is
what `handle.method` is to a caller that awaits `handle.method.remote(*args)`."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any


class AsyncMethod:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Coroutine[Any, Any, Any]:
        async def call() -> Any:
            return self.fn(*args)

        return call()
