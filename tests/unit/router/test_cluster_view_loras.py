"""Which workers a LoRA request may go to (ClusterView over fake worker handles): only those
that have the adapter registered, each marked cold when its adapter cache does not hold it;
the names the cluster serves, for validation and the HTTP door's /v1/models."""

from __future__ import annotations

import asyncio
import dataclasses

from router_fakes import Method

from prefix_index.types import PrefixMatch
from router.cluster_view import ClusterView, StaticDirectory
from vocabulary.engine_io import EngineLoad
from vocabulary.worker_api import WorkerInfo, WorkerLoad, WorkerRole, WorkerState


class Worker:
    """A worker actor's `load`: registered adapters, and those its adapter cache holds."""

    def __init__(self, info: WorkerInfo, registered: tuple[str, ...], held: tuple[str, ...]):
        zero = EngineLoad(*([0] * len(dataclasses.fields(EngineLoad))))
        engine = dataclasses.replace(zero, loras=held, num_total_blocks=100, num_free_blocks=100)
        self.answer = WorkerLoad(
            info.worker_id, info.role, WorkerState.READY, engine, 0, 0, loras=registered
        )
        self.load = Method(self._load)

    async def _load(self) -> WorkerLoad:
        return self.answer


def _info(worker_id: str, role: WorkerRole) -> WorkerInfo:
    return WorkerInfo(worker_id, role, "a", "n", "cpu", "tiny", 16, 512, 512, 64)


def test_lora_requests_go_only_to_workers_that_registered_the_adapter() -> None:
    workers = [
        (_info("p0", WorkerRole.PREFILL), ("a", "b"), ("a",)),
        (_info("p1", WorkerRole.PREFILL), ("a",), ()),
        (_info("d0", WorkerRole.DECODE), ("a", "b"), ("b",)),
        (_info("d1", WorkerRole.DECODE), (), ()),
    ]

    async def body() -> None:
        view = ClusterView(StaticDirectory([(i, Worker(i, r, h)) for i, r, h in workers]))
        await view.refresh_registry()
        await view.poll_loads()
        match = PrefixMatch(chain_length=0, available=True)
        pre = {c.worker_id: c.cold_lora for c in view.prefill_candidates(match, "a")}
        assert pre == {"p0": False, "p1": True}
        assert [c.worker_id for c in view.prefill_candidates(match, "b")] == ["p0"]
        dec = {c.worker_id: c.cold_lora for c in view.decode_candidates(match, "a")}
        assert dec == {"d0": True}
        base = view.decode_candidates(match)
        assert sorted(c.worker_id for c in base) == ["d0", "d1"]
        assert not any(c.cold_lora for c in base)
        assert view.lora_names() == {"a", "b"}
        assert view.serves_lora("b") and not view.serves_lora("c")
        view.entries["p0"].mark_dead()
        view.entries["d0"].mark_dead()
        assert view.lora_names() == {"a"}
        assert not view.serves_lora("b")

    asyncio.run(body())
