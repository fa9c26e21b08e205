"""A tensor-parallel worker's health covers every rank (worker_runtime/tp_ranks.py): a follower
whose ping fails (its actor died, or it reports it cannot serve) or a broken group makes rank
0's probe report the ranks DIED, which `check_health` turns into WorkerUnhealthy; healthy
followers keep it RUNNING. Fake follower handles (`.ping.remote()`) and a stub group."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.tp.tensor_parallel import TPGroupState
from kv_transfer.config import KVTransferConfig
from vocabulary.loop_progress import LoopState
from worker_runtime import tp_ranks
from worker_runtime.runtime import TP_RANKS, stall_reason
from worker_runtime.tp_ranks import TPRanks

pytestmark = pytest.mark.timeout(30)


class Follower:
    """`handle.ping.remote()` as Ray gives it: an awaitable of the answer or the error."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.ping = self

    def remote(self) -> Any:
        async def answer() -> str:
            if self.error is not None:
                raise self.error
            return "serving"

        return answer()


class Group:
    state = TPGroupState.OPEN
    failure = ""


async def watch(ranks: TPRanks, rounds: int) -> list[LoopState]:
    ranks._pinger = asyncio.get_running_loop().create_task(ranks._ping_loop())
    states = []
    for _ in range(rounds):
        await asyncio.sleep(0.05)
        states.append(ranks.probe().state)
    ranks._pinger.cancel()
    return states


def test_a_follower_whose_ping_fails_makes_the_worker_unhealthy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tp_ranks, "PING_INTERVAL_S", 0.01)
    followers = [Follower(), Follower()]
    ranks = TPRanks(followers, "w0", KVTransferConfig())
    assert asyncio.run(watch(ranks, 3)) == [LoopState.RUNNING] * 3  # idle and healthy
    followers[1].error = RuntimeError("The actor died unexpectedly")
    assert asyncio.run(watch(ranks, 3))[-1] is LoopState.DIED
    why = stall_reason(TP_RANKS, ranks.probe(), 60.0)
    assert why == "TP ranks died (rank 2: RuntimeError: The actor died unexpectedly)"


def test_a_broken_group_makes_the_worker_unhealthy_even_with_every_actor_alive() -> None:
    ranks = TPRanks([Follower()], "w0", KVTransferConfig())
    group = Group()
    ranks.group = group  # type: ignore[assignment]
    assert ranks.probe().state is LoopState.RUNNING
    group.state, group.failure = TPGroupState.BROKEN, "rank 0: sending a step: no answer"
    assert ranks.failure() == "TP group broken (rank 0: sending a step: no answer)"
    assert ranks.probe().state is LoopState.DIED
