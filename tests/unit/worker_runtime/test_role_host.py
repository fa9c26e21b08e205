"""`RoleHost`'s refusals, in-process and without an engine (nothing is started): each names
what is wrong and leaves the worker as it was; a call of a role the worker does not serve is
refused as a draining worker's (the router places it elsewhere)."""

from __future__ import annotations

import asyncio

import pytest

from deploy.control.worker_actors import ROLE_CLASSES
from engine.config import EngineConfig
from kv_transfer.config import KVTransferConfig
from vocabulary.worker_api import RoleSwitchRefused, WorkerDraining, WorkerRole, WorkerState
from worker_runtime.role_host import RoleHost
from worker_runtime.runtime import WorkerConfig


@pytest.fixture(autouse=True)
def no_trim_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker starts its process's malloc_trim thread: not in the test process."""
    monkeypatch.setenv("PDSERVE_MALLOC_TRIM_S", "0")


def host(role: WorkerRole, tp: int = 1, ready: bool = True) -> RoleHost:
    engine = EngineConfig(model_dir="unused", tensor_parallel_size=tp)
    config = WorkerConfig(worker_id="w0", role=role, engine=engine)
    h = RoleHost(config, KVTransferConfig(), "w0", [object()] * (tp - 1), ROLE_CLASSES)
    if ready:
        h.runtime.state = WorkerState.READY
    return h


@pytest.mark.parametrize(
    ("role", "to", "tp", "ready", "why"),
    [
        (WorkerRole.DECODE, WorkerRole.DECODE, 1, True, "w0 is a decode worker already"),
        (WorkerRole.PREFILL, WorkerRole.DECODE, 1, False,
         "w0 is starting: only a ready worker switches"),
        (WorkerRole.PREFILL, WorkerRole.SPLIT, 2, True,
         "w0 runs on 2 ranks; a split worker runs on one device"),
    ],
)  # fmt: skip
def test_a_refused_switch_names_why_and_changes_nothing(
    role: WorkerRole, to: WorkerRole, tp: int, ready: bool, why: str
) -> None:
    h = host(role, tp, ready)
    state, config, role_object = h.runtime.state, h.runtime.config, h.role
    assert h.switch_refusal(to) == why
    with pytest.raises(RoleSwitchRefused, match=f"^{why}$"):
        asyncio.run(h.switch_role(to, 1.0))
    assert (h.runtime.state, h.runtime.config, h.role) == (state, config, role_object)


def test_a_role_without_a_class_is_refused() -> None:
    h = host(WorkerRole.PREFILL)
    h._roles = {r: c for r, c in h._roles.items() if r is not WorkerRole.SPLIT}
    assert h.switch_refusal(WorkerRole.SPLIT) == ("role: split is not a role this worker can serve")
    config = WorkerConfig(worker_id="w1", role=WorkerRole.SPLIT, engine=EngineConfig("unused"))
    with pytest.raises(ValueError, match="roles: no class serves the split role"):
        RoleHost(
            config,
            KVTransferConfig(),
            "w1",
            (),
            {WorkerRole.DECODE: ROLE_CLASSES[WorkerRole.DECODE]},
        )


def test_a_call_of_another_roles_method_is_refused_as_draining() -> None:
    decode = host(WorkerRole.DECODE)
    with pytest.raises(WorkerDraining, match="w0 serves the decode role now: no handshake_info"):
        decode.handshake_info()
    prefill = host(WorkerRole.PREFILL)
    with pytest.raises(WorkerDraining, match="w0 serves the prefill role now: no transfer_stats"):
        prefill.transfer_stats()
    assert prefill.renew("channel") is False and prefill.channels() == []
