"""What the controller runs: `ClusterSpec`, the model and the workers of each role, and how
they are placed, checked and replaced. In a cluster's config tree (deploy/control/config_tree.py) it
is the `workers:` section; `Cluster` fills in the model folder, Redis and `fixed_capacity`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from deploy.control.worker_actors import default_placement
from engine.config import EngineConfig
from kv_transfer.config import KVTransferConfig
from planner.loop import PlannerSettings
from prefix_index.config import PrefixIndexConfig
from vocabulary.model_config import ModelConfig
from vocabulary.worker_api import ActorPlacement, WorkerRole
from worker_runtime.runtime import engine_mode


@dataclass(frozen=True)
class WorkerPlacement:
    """Ray resources per worker, by role (None: the next more general one)."""

    default: ActorPlacement | None = None
    """Every worker's; None: one GPU each where there are GPUs, else half a CPU."""
    prefill: ActorPlacement | None = None
    """Prefill workers' (e.g. a custom resource that only the prefill node group has)."""
    decode: ActorPlacement | None = None
    """Decode (and colocated) workers'."""


@dataclass(frozen=True)
class ClusterSpec:
    """What the controller runs: the model, how many workers of each role, and how."""

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(model_dir=""))
    """Base engine settings; the mode is set per role."""
    num_prefill: int = 1
    """Prefill workers started with the cluster (0: decode workers prefill everything)."""
    num_decode: int = 1
    """Decode workers started with the cluster (with num_split, at least 1 in all)."""
    num_split: int = 0
    """Split workers started with the cluster: prefill and decode in one worker on one
    device, in two loops over one KV pool, each in a partition of the SMs of its own
    (engine mode split). They serve as decode workers that prefill their own prompts."""
    colocated: bool = False
    """Baseline mode: decode workers get the COLOCATED role and no prefill workers run."""
    prefill_tp: int = 1
    """Tensor-parallel ranks (devices) of each prefill worker: N ranks on one node, one
    worker to the router, controller, admission and status (engine.tensor_parallel_size)."""
    decode_tp: int = 1
    """Tensor-parallel ranks of each decode (or colocated) worker. When it differs from
    prefill_tp, engine.kv_layout auto becomes head_major on every worker (each decode rank
    reads its KV heads of a block in one piece; engine/kv/kv_cache.py)."""
    prefill_pp: int = 1
    """Pipeline stages of each prefill worker (engine.pipeline_parallel_size): a worker is
    prefill_pp x prefill_tp ranks, stage s holding layers [a_s, b_s) and their KV
    (vocabulary/pipeline.py), on one node where they fit, else over the Ray cluster's nodes.
    The stages must divide the model's layers unless prefill_pp_layers is given."""
    decode_pp: int = 1
    """Pipeline stages of each decode (or colocated) worker; the KV hand-off reads each layer
    range from the prefill stage that holds it (kv_transfer/tp_plan.py)."""
    prefill_pp_layers: tuple[int, ...] = ()
    """Layers of each prefill stage (prefill_pp counts summing to the model's layers); empty:
    equal stages."""
    decode_pp_layers: tuple[int, ...] = ()
    """Layers of each decode stage; empty: equal stages."""
    redis_url: str | None = None
    """The prefix index's Redis; None: no index (placement on load alone)."""
    transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    """KV hand-off between prefill and decode workers: leases, deadlines, budgets."""
    index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)
    """The Redis prefix index: workers publish their cached blocks, routers look them up."""
    placement: WorkerPlacement = field(default_factory=WorkerPlacement)
    """Ray resources per worker, by role."""
    torch_threads: int = 1
    """CPU threads each worker's torch may use."""
    stall_timeout_s: float = 60.0
    """A worker whose engine or transfer loop has work and makes no progress this long is
    unhealthy: removed from placement and replaced (WorkerConfig.stall_timeout_s)."""
    cluster_name: str = "pdserve"
    """The cluster's name (`cluster.name`): the Ray namespace its workers are named in."""
    fixed_capacity: bool = False
    """The Ray has the resources it started with (a local Ray that pdserve started): a
    rebalance that could never place its new workers is refused before anything drains."""
    replace_dead: bool = True
    """Start a fresh worker of the same role in place of a ready one removed as dead."""
    health_interval_s: float = 1.0
    """Seconds between the controller's health pings of the workers."""
    failure_threshold: int = 3
    """Health pings in a row without an answer after which a worker is removed as dead (an
    actor that died, or one that reports itself unhealthy, is removed at once)."""
    start_timeout_s: float = 900.0
    """Longest a worker may take to start (model load, KV pool, NIXL agent)."""
    planner: PlannerSettings = field(default_factory=PlannerSettings)
    """The planner loop (off by default)."""

    def __post_init__(self) -> None:
        if self.num_split and self.decode_tp != 1:
            raise ValueError("decode_tp: split workers run on one device (decode_tp 1)")
        if self.num_split and self.decode_pp != 1:
            raise ValueError("decode_pp: split workers run on one device (decode_pp 1)")
        if self.engine.tensor_parallel_size != 1:
            raise ValueError(
                "engine.tensor_parallel_size: set prefill_tp / decode_tp (--prefill-tp, "
                "--decode-tp) for a cluster's workers"
            )
        if self.engine.pipeline_parallel_size != 1 or self.engine.pipeline_layer_partition:
            raise ValueError(
                "engine.pipeline_parallel_size: set prefill_pp / decode_pp (--prefill-pp, "
                "--decode-pp) and prefill_pp_layers / decode_pp_layers for a cluster's workers"
            )

    @property
    def decode_role(self) -> WorkerRole:
        """The role the decode side's new workers get: colocated in the baseline mode, split
        in a cluster of split workers only, else decode."""
        if self.colocated:
            return WorkerRole.COLOCATED
        if self.num_split and not self.num_decode and not self.num_prefill:
            return WorkerRole.SPLIT
        return WorkerRole.DECODE

    def tp_for(self, role: WorkerRole) -> int:
        """Tensor-parallel ranks of a worker of `role` (of each of its stages)."""
        return self.prefill_tp if role is WorkerRole.PREFILL else self.decode_tp

    def pp_for(self, role: WorkerRole) -> tuple[int, tuple[int, ...]]:
        """(pipeline stages, their layer counts or empty) of a worker of `role`."""
        if role is WorkerRole.PREFILL:
            return self.prefill_pp, self.prefill_pp_layers
        return self.decode_pp, self.decode_pp_layers

    def ranks_for(self, role: WorkerRole) -> int:
        """Ranks (devices) of a worker of `role`: stages x TP ranks."""
        return self.pp_for(role)[0] * self.tp_for(role)

    @property
    def kv_layout(self) -> str:
        """The KV layout every worker uses: engine.kv_layout, with auto resolved where workers
        hand KV to each other (module docstring of engine/kv/kv_cache.py): head_major when
        prefill and decode TP differ, else block_major (a run of adjacent blocks is one NIXL
        descriptor; layer_major would make it one a layer). A colocated cluster hands nothing
        off, so auto stays for each engine to resolve (layer_major on a GPU)."""
        layout = self.engine.kv_layout
        if layout != "auto" or self.colocated:
            return layout
        return "head_major" if self.prefill_tp != self.decode_tp else "block_major"

    @property
    def host_kv_handoff(self) -> bool:
        """engine.host_kv_handoff where the cluster's hand-offs can read host-tier blocks:
        only between two workers of one rank each (a worker of several ranks, TP or PP, on
        either side reads or lends KV pools only, kv_transfer/plan.py), so a cluster with
        one hands off from the device pools instead of failing its hand-offs. The same for
        every role, since a worker may switch roles."""
        single = self.ranks_for(WorkerRole.PREFILL) == 1 and self.ranks_for(self.decode_role) == 1
        return self.engine.host_kv_handoff and (self.colocated or single)

    def engine_for(self, role: WorkerRole) -> EngineConfig:
        """The engine of a worker of `role`: its mode, TP size, pipeline stages, the
        cluster's KV layout and whether it lends host-tier blocks to hand-offs."""
        mode = engine_mode(role)
        stages, layers = self.pp_for(role) if role is not WorkerRole.SPLIT else (1, ())
        return replace(
            self.engine, mode=mode, tensor_parallel_size=self.tp_for(role),
            pipeline_parallel_size=stages, pipeline_layer_partition=layers,
            kv_layout=self.kv_layout, host_kv_handoff=self.host_kv_handoff,
        )  # fmt: skip

    def tp_refusal(self, model: ModelConfig) -> tuple[str, str] | None:
        """(the field at fault, why) when these TP sizes and pipeline stages cannot serve
        `model` (a TP size that does not split it, stages that do not cut its layers as
        stated, or a prefill/decode pair of layouts no hand-off plan reads in the KV layout
        asked for), the numbers named; None when they can."""
        from engine.tp.tp_shard import check_tp_size
        from kv_transfer.tp_plan import UnsupportedSplit, check_handoff_layouts
        from vocabulary.pipeline import stage_layer_bounds

        sides = [("decode", self.decode_tp, self.decode_pp, self.decode_pp_layers)]
        if not self.colocated:
            sides.insert(0, ("prefill", self.prefill_tp, self.prefill_pp, self.prefill_pp_layers))
        for side, tp, pp, layers in sides:
            try:
                check_tp_size(model, tp)
            except ValueError as e:
                return f"{side}_tp", str(e)
            try:
                stage_layer_bounds(model.num_layers, pp, layers)
            except ValueError as e:
                return (f"{side}_pp_layers" if layers else f"{side}_pp"), str(e)
        if self.colocated:
            return None
        try:
            check_handoff_layouts(
                self.prefill_pp, self.prefill_tp, self.decode_pp, self.decode_tp,
                model.num_layers, model.num_kv_heads, self.kv_layout,
                self.prefill_pp_layers, self.decode_pp_layers,
            )  # fmt: skip
        except UnsupportedSplit as e:
            return "engine.kv_layout", str(e)
        return None

    @property
    def switch_roles(self) -> tuple[WorkerRole, ...]:
        """The roles a worker of this cluster may switch to: prefill (not in a colocated
        cluster: it hands nothing off), the decode side's role, split."""
        roles = [] if self.colocated else [WorkerRole.PREFILL]
        return tuple(dict.fromkeys([*roles, self.decode_role, WorkerRole.SPLIT]))

    def switch_refusal(self, have: WorkerRole, role: WorkerRole) -> str | None:
        """Why a worker of role `have` cannot become one of `role` in place, the options at
        fault named (None: it can). A switch keeps the worker's model, ranks and Ray
        resources: the two roles' workers must run the same engine but for its mode, and ask
        Ray for the same placement; a split worker runs on one device."""
        if role is WorkerRole.SPLIT and self.ranks_for(have) > 1:
            return (
                f"{have.value} workers run on {self.ranks_for(have)} ranks "
                f"({have.value}_tp x {have.value}_pp); a split worker runs on one device"
            )
        side = {WorkerRole.PREFILL: "prefill"}
        a, b = side.get(have, "decode"), side.get(role, "decode")
        if role is not WorkerRole.SPLIT and a != b:
            shape = {r: (self.tp_for(r), *self.pp_for(r)) for r in (have, role)}
            if shape[have] != shape[role]:
                (tp_a, pp_a, layers_a), (tp_b, pp_b, layers_b) = shape[have], shape[role]
                return (
                    f"{a}_tp/{a}_pp {tp_a}/{pp_a} ({a}_pp_layers {list(layers_a)}) differ from "
                    f"{b}_tp/{b}_pp {tp_b}/{pp_b} ({b}_pp_layers {list(layers_b)}): a switch "
                    "keeps a worker's ranks"
                )
        asks = {r: self.worker_asks(r) for r in (have, role)}
        if asks[have] != asks[role]:
            return (
                f"placement: {have.value} workers ask Ray for {asks[have]}, {role.value} workers "
                f"for {asks[role]}: a switch keeps a worker's resources"
            )
        return None

    def initial_roles(self) -> list[WorkerRole]:
        """The role of each worker `Controller.start` starts."""
        roles = [WorkerRole.PREFILL] * (0 if self.colocated else self.num_prefill)
        decode_role = WorkerRole.COLOCATED if self.colocated else WorkerRole.DECODE
        return roles + [decode_role] * self.num_decode + [WorkerRole.SPLIT] * self.num_split

    def placement_for(self, role: WorkerRole) -> ActorPlacement:
        """Ray resources of a worker of `role` (call with Ray initialized: the default looks
        at the cluster's GPUs)."""
        p = self.placement
        specific = p.prefill if role is WorkerRole.PREFILL else p.decode
        return specific or p.default or default_placement()

    def worker_asks(self, role: WorkerRole) -> ActorPlacement:
        """What one worker of `role` holds on Ray: its rank's placement, once per rank
        (stages x TP ranks)."""
        return self.placement_for(role).times(self.ranks_for(role))
