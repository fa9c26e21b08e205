"""The shared cluster of the router tests (see conftest.py) and helpers over it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc
from vocabulary.worker_api import WorkerInfo, WorkerLoad, WorkerRole

MAX_MODEL_LEN = 1024
KV_BLOCKS = 256
TENANTS = ("", "acme")
MAX_MESSAGE_BYTES = 4 << 20
TOKEN_GAP_S = 10.0
STALL_TIMEOUT_S = 5.0

SERVED_LORA = "tiny-sql"
"""The LoRA adapter the shared cluster serves from the start (test_router_lora)."""


@dataclass(frozen=True)
class LoraAdapters:
    """PEFT adapter folders made for the router tests (conftest `lora_adapters`)."""

    sql: Path
    chat: Path


@dataclass
class RouterCluster:
    """The running cluster, its endpoints and direct handles to its workers."""

    cluster: Any  # deploy.control.launch.Cluster
    targets: tuple[str, ...]
    metrics_urls: tuple[str, ...]
    redis_url: str
    model_dir: Path
    model_id: str
    workers: dict[str, tuple[WorkerInfo, Any]]
    channels: list[grpc.Channel]
    admin_targets: tuple[str, ...] = ()
    """Each router's admin plane (the Admin service has its own port)."""
    admin_channels: list[grpc.Channel] = field(default_factory=list)
    name: str = "router-tests"
    """`cluster.name`: the Ray namespace of its actors, the prefix of its index keys."""

    def prefix_index(self) -> Any:
        """A client of the cluster's prefix index (its keys under the cluster's name)."""
        from prefix_index.config import PrefixIndexConfig
        from prefix_index.index import PrefixIndex

        return PrefixIndex(self.redis_url, self.model_id, PrefixIndexConfig(key_prefix=self.name))

    def channel(self, router: int = 0) -> grpc.Channel:
        return self.channels[router]

    def generation(self, router: int = 0) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(self.channels[router])

    def admin(self, router: int = 0) -> pb_grpc.AdminStub:
        return pb_grpc.AdminStub(self.admin_channels[router])

    def worker_ids(self, role: WorkerRole) -> list[str]:
        return sorted(w for w, (info, _) in self.workers.items() if info.role is role)

    def handle(self, worker_id: str) -> Any:
        return self.workers[worker_id][1]

    def loads(self) -> dict[str, WorkerLoad]:
        import ray

        ids = sorted(self.workers)
        got = ray.get([self.handle(w).load.remote() for w in ids], timeout=30)
        return dict(zip(ids, got, strict=True))

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, WorkerLoad]:
        """Wait until every worker is back at its idle baseline; returns the last loads.

        Idle: no KV block in use (evictable prefix-cache blocks count as free), nothing
        queued, running, in flight, leased or being transferred, and no request in flight
        in either router.
        """
        end = time.monotonic() + timeout_s
        while True:
            loads = self.loads()
            busy = {w: load.held() for w, load in loads.items() if load.held()}
            for i in range(len(self.channels)):
                n = self.admin(i).Status(pb.StatusRequest(), timeout=10).router_inflight_requests
                if n:
                    busy[f"router-{i}"] = f"{n} requests in flight"
            if not busy:
                return loads
            if time.monotonic() > end:
                raise AssertionError(f"not idle after {timeout_s}s: {busy}")
            time.sleep(0.1)

    @contextmanager
    def restored_thresholds(self, router: int = 0) -> Iterator[pb.AdmissionThresholds]:
        """Yield the router's thresholds; put every field back afterwards."""
        admin = self.admin(router)
        before = admin.GetThresholds(pb.GetThresholdsRequest(), timeout=10)
        try:
            yield before
        finally:
            restore = pb.AdmissionThresholds()
            restore.CopyFrom(before)
            # 0 means "keep" in SetThresholds; a threshold of 0 tokens behaves like 1 here
            # (only a fully cached prompt has 0 uncached tokens).
            if restore.local_prefill_threshold_tokens == 0:
                restore.local_prefill_threshold_tokens = 1
            admin.SetThresholds(restore, timeout=10)


def kill_and_await_controller(controller: Any, timeout_s: float = 120.0) -> list[str]:
    """Kill the controller actor so that Ray restarts it (as after an OOM or a node fault)
    and wait until it says it restarted; returns its events then."""
    import ray

    ray.kill(controller, no_restart=False)  # dies; Ray makes it again from the same spec
    end = time.monotonic() + timeout_s
    while True:
        try:
            events: list[str] = ray.get(controller.recent_events.remote(), timeout=10)
            if any("controller restarted" in e for e in events):
                return events
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < end, "the controller did not come back"
        time.sleep(0.2)
