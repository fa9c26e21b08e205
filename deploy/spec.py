"""What the controller runs: `ClusterSpec`, the model and the workers of each role, and how
they are placed, checked and replaced."""

from __future__ import annotations

from dataclasses import dataclass, field

from deploy.workers import ActorPlacement, default_placement
from engine.config import EngineConfig
from kv_transfer.config import KVTransferConfig
from planner.loop import PlannerSettings
from prefix_index.config import PrefixIndexConfig
from worker_runtime.api import WorkerRole


@dataclass(frozen=True)
class ClusterSpec:
    """What the controller runs: the model, how many workers of each role, and how."""

    engine: EngineConfig
    """Base engine settings; the mode is set per role."""
    num_prefill: int = 1
    num_decode: int = 1
    colocated: bool = False
    """Baseline mode: decode workers get the COLOCATED role and no prefill workers run."""
    redis_url: str | None = None
    transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)
    placement: ActorPlacement | None = None
    """Ray resources per worker; None: one GPU each where there are GPUs, else half a CPU."""
    prefill_placement: ActorPlacement | None = None
    decode_placement: ActorPlacement | None = None
    torch_threads: int = 1
    stall_timeout_s: float = 60.0
    """A worker whose engine or transfer loop has work and makes no progress this long is
    unhealthy: removed from placement and replaced (WorkerConfig.stall_timeout_s)."""
    fixed_capacity: bool = False
    """The Ray has the resources it started with (a local Ray that pdserve started): a
    rebalance that could never place its new workers is refused before anything drains."""
    replace_dead: bool = True
    health_interval_s: float = 1.0
    failure_threshold: int = 3
    start_timeout_s: float = 900.0
    planner: PlannerSettings = field(default_factory=PlannerSettings)
    """The planner loop (off by default)."""

    def initial_roles(self) -> list[WorkerRole]:
        """The role of each worker `Controller.start` starts."""
        roles = [WorkerRole.PREFILL] * (0 if self.colocated else self.num_prefill)
        decode_role = WorkerRole.COLOCATED if self.colocated else WorkerRole.DECODE
        return roles + [decode_role] * self.num_decode

    def placement_for(self, role: WorkerRole) -> ActorPlacement:
        """Ray resources of a worker of `role` (call with Ray initialized: the default looks
        at the cluster's GPUs)."""
        specific = self.prefill_placement if role is WorkerRole.PREFILL else self.decode_placement
        return specific or self.placement or default_placement()
