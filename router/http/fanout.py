"""Several choices of one request, served at once and read as one sequence of deltas.

Each choice is one orchestrator request run in its own task. A prompt's first sibling starts
at once; its other siblings start when it has its first token: the prompt's blocks are then
computed and in the prefix cache (and on their way into the Redis index), so the siblings
reuse them instead of computing the same prompt side by side.

    fanout.start()          tasks of every prompt's first sibling
    await fanout.next()     (choice index, delta) | (index, the error it failed with) |
                            (index, None) once its stream ended
    await fanout.close()    cancel what still runs (aborting it on its workers) and wait
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable

from router.http.translate import Choice, GenerationPlan
from router.progress import StreamDelta
from router.validation import ValidRequest

Item = tuple[int, StreamDelta | BaseException | None]
Generate = Callable[[ValidRequest, float | None], AsyncIterator[StreamDelta]]


class Fanout:
    """The choices of `plan`, served by `generate` (the orchestrator's)."""

    def __init__(self, plan: GenerationPlan, generate: Generate) -> None:
        self.plan = plan
        self._generate = generate
        self._items: asyncio.Queue[Item] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        n = self.plan.n
        for first in self.plan.choices[::n]:
            siblings = self.plan.choices[first.index + 1 : first.index + n]
            self._spawn(first, functools.partial(self._spawn_all, siblings))

    def put(self, item: Item) -> None:
        """Put an item of the caller's own among the deltas (e.g. "the client left")."""
        self._items.put_nowait(item)

    async def next(self) -> Item:
        return await self._items.get()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, choice: Choice, on_first: Callable[[], None] | None) -> None:
        self._tasks.append(asyncio.create_task(self._run(choice, on_first)))

    def _spawn_all(self, choices: tuple[Choice, ...]) -> None:
        for choice in choices:
            self._spawn(choice, None)

    async def _run(self, choice: Choice, on_first: Callable[[], None] | None) -> None:
        stream = self._generate(choice.request, self.plan.timeout_s)
        try:
            async for delta in stream:
                self._items.put_nowait((choice.index, delta))
                if on_first is not None:
                    on_first()
                    on_first = None
        except Exception as e:
            self._items.put_nowait((choice.index, e))
        self._items.put_nowait((choice.index, None))
