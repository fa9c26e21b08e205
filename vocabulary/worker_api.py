"""What every worker says across the Ray boundary, whatever its role (frozen, tensor-free,
torch-free): `WorkerRole`, `WorkerState`, `WorkerInfo`, `WorkerLoad`, and the typed errors a
worker raises to its caller. The router and the controller import this, never a role's actor.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from vocabulary.engine_io import EngineLoad
from vocabulary.kv_events import PublisherStats
from vocabulary.transfer_load import TransferLoad, TransferStats


class WorkerRole(enum.Enum):
    """What a worker does: PREFILL hands its prompts' KV off; DECODE pulls KV and decodes
    (prefilling short prompts itself); COLOCATED prefills and decodes in one loop; SPLIT
    prefills and decodes in two loops on one device (engine mode split)."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"
    SPLIT = "split"

    @property
    def decodes(self) -> bool:
        """A worker of this role serves decode streams (every role but PREFILL)."""
        return self is not WorkerRole.PREFILL


class WorkerState(enum.Enum):
    """A worker reports STARTING → READY → DRAINING → STOPPED (DRAINING → READY on
    `undrain`). DRAINED is the controller's name for a draining worker that finished its work
    and was kept (not stopped); the worker itself still reports DRAINING."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DRAINED = "drained"
    STOPPED = "stopped"


@dataclass(frozen=True)
class WorkerInfo:
    """Identity and placement of a worker: fixed for its life, but for `role`, which a role
    switch changes (the same actor, engine and KV pool serve the new role)."""

    worker_id: str
    role: WorkerRole
    actor_name: str
    node: str
    device: str
    model_id: str
    block_size: int
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    weights_dtype: str = ""
    """The model dtype (embeddings, norms, head; the projections too unless quantized)."""
    quantization: str = "none"
    """How the decoder projections are stored: none (weights_dtype) or fp8."""
    weight_bytes: int = 0
    """Bytes of every weight the worker's model holds."""
    kv_cache_dtype: str = ""
    """Element type of the KV pool (e.g. bfloat16, float8_e4m3fn)."""
    kv_cache_bytes: int = 0
    """Bytes of the KV pool (rank 0's, with tensor parallelism: each rank has one)."""
    tp_size: int = 1
    """Tensor-parallel ranks (devices) of the worker (of each pipeline stage); it is one
    worker all the same."""
    pp_size: int = 1
    """Pipeline stages of the worker, each of `tp_size` ranks (pp_size x tp_size devices)."""
    kv_layout: str = ""
    """Layout of the KV pool (engine/kv/kv_cache.py)."""


@dataclass(frozen=True)
class ProcessCounts:
    """What a worker process holds that must come back to its idle baseline once its
    requests are over (a steady count under steady load; growth is a leak): open file
    descriptors, Python threads, asyncio tasks on the actor's loop."""

    fds: int = 0
    threads: int = 0
    tasks: int = 0

    def __str__(self) -> str:
        return f"fds {self.fds}, threads {self.threads}, tasks {self.tasks}"


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load, taken without touching its engine thread (cheap to poll)."""

    worker_id: str
    role: WorkerRole
    state: WorkerState
    engine: EngineLoad
    inflight_requests: int
    requests_done: int
    transfer: TransferLoad = field(default_factory=TransferLoad)
    """Decode side: blocks being pulled (queued + in flight)."""
    leased_blocks: int = 0
    """Prefill side: blocks held under leases until a decode worker pulls them."""
    leases_held: int = 0
    leases_expired: int = 0
    prefill_tokens_per_s: float = 0.0
    """Observed prefill throughput (prompt tokens computed per busy second), 0 until known."""
    index_publish_errors: int = 0
    """Failed rounds of the KV-event publisher so far (Redis down, a bad event): a prefix
    index that goes stale shows here."""
    timestamp: float = 0.0
    transfer_stats: TransferStats | None = None
    """Decode side: cumulative KV-transfer figures (bytes, time, failures); None without a
    transfer endpoint."""
    index: PublisherStats | None = None
    """The KV-event publisher's state (connected to Redis, resyncs); None without one."""
    loras: tuple[str, ...] = ()
    """LoRA adapters registered on the worker (`engine.loras`: those whose weights it holds)."""
    process: ProcessCounts = field(default_factory=ProcessCounts)
    """The worker process's fds, threads and asyncio tasks (`WorkerRuntime.process_counts`)."""

    @property
    def requests_held(self) -> int:
        """Requests it holds (queued, running, streaming) and a prefill worker's leases: what a
        drain waits for."""
        return self.inflight_requests + self.leases_held

    def held(self) -> str:
        """What the worker holds beyond its idle baseline ("" when idle): KV blocks in use
        (evictable prefix-cache blocks count as free), requests queued, running or in
        flight, blocks held for a hand-off, reserved for or being pulled, leases, host-tier
        slots pinned (lent to a hand-off, read by an onboard) and copies holding budget."""
        e = self.engine
        parts = {
            "kv_used": e.num_total_blocks - e.num_free_blocks,
            "waiting": e.num_waiting,
            "running": e.num_running,
            "handoff_blocks": e.num_handoff_blocks,
            "transfer_blocks": e.num_transfer_blocks,
            "inflight_requests": self.inflight_requests,
            "leased_blocks": self.leased_blocks,
            "leases": self.leases_held,
            "pulling_blocks": self.transfer.pending_blocks,
            "host_pinned": e.host_tier.num_pinned if e.host_tier is not None else 0,
            "host_copies": (
                e.host_tier.onboard.inflight_blocks + e.host_tier.offload.inflight_blocks
                if e.host_tier is not None
                else 0
            ),
        }
        return ", ".join(f"{k}={v}" for k, v in parts.items() if v)


@dataclass(frozen=True)
class RoleSwitch:
    """What a worker's role switch did (worker_runtime/role_host.py `RoleHost.switch_role`)."""

    switched: bool
    """The worker serves its new role (False: its work outlasted the drain timeout; it went
    back into service in its old role, nothing changed)."""
    info: WorkerInfo
    """The worker as it is now (its new role when switched)."""
    message: str
    requests_at_start: int
    """Requests and leases the worker held when its drain began."""
    drain_s: float = 0.0
    """Seconds until its old role held nothing."""
    flip_s: float = 0.0
    """Seconds from then until it admitted as its new role (endpoints, engine mode)."""


class RoleSwitchRefused(Exception):
    """A role switch that cannot be done as asked (an unknown worker or role, the role it has,
    a worker draining, the last worker of its role, a shape the role cannot run); nothing was
    changed."""


class WorkerDraining(Exception):
    """The worker is draining and admits no new request: place it elsewhere."""


class WorkerUnhealthy(Exception):
    """The worker's engine fails every step (e.g. a sticky device error): replace it."""


class StepFailed(Exception):
    """The engine step that carried this request raised; the request was aborted (another
    worker may serve it)."""


class WorkerStopped(Exception):
    """The worker is stopping or stopped: place the request elsewhere."""


class WorkerOverloaded(Exception):
    """The worker cannot hold this request now (e.g. KV pool short): place it elsewhere."""


class RequestAborted(Exception):
    """`abort(request_id)` ended the request on the worker; everything it held was freed."""


class RequestDeadlineExceeded(Exception):
    """The request's deadline passed on the worker; everything it held was freed."""


@dataclass(frozen=True)
class ActorPlacement:
    """Ray resources of one worker actor."""

    num_gpus: float = 0.0
    num_cpus: float = 0.5
    resources: tuple[tuple[str, float], ...] = ()
    """Custom resources (e.g. ("prefill", 1)) for node groups of an autoscaling cluster."""
    max_restarts: int = 0
    """Ray restarts of a crashed actor; 0 lets the controller replace it with a fresh one."""

    def times(self, n: int) -> ActorPlacement:
        """What `n` actors of this placement ask for together (a TP worker of `n` ranks)."""
        return ActorPlacement(
            self.num_gpus * n,
            self.num_cpus * n,
            tuple((name, amount * n) for name, amount in self.resources),
            self.max_restarts,
        )

    def bundle(self) -> dict[str, float]:
        """One rank's placement-group bundle (a bundle must ask for something: a sliver of
        CPU when the placement asks for nothing)."""
        asks = {"GPU": self.num_gpus, "CPU": self.num_cpus, **dict(self.resources)}
        return {k: v for k, v in asks.items() if v > 0} or {"CPU": 0.001}


ACTOR_NAME_PREFIX = "pdserve-worker-"


def actor_name_for(worker_id: str) -> str:
    """The Ray actor name of a worker (namespace: the cluster's), e.g. for handshakes."""
    return f"{ACTOR_NAME_PREFIX}{worker_id}"
