"""What a simulation runs (simulator/cluster.py): the workers of each kind, their TP sizes,
pools and prefill chunk, split workers' parameters, pairs sharing a device, and the router's
settings; a shape that cannot be simulated is refused naming its flag."""

from __future__ import annotations

from dataclasses import dataclass

from admission.config import AdmissionThresholds
from router.prefill_cost import LocalPrefillPolicy
from simulator.split import SplitParams

DEFAULT_THRESHOLDS = AdmissionThresholds()
DEFAULT_SPLIT = SplitParams()
SHARED_DEVICE_SLOWDOWN = 2.0
"""A step's time over alone while the other worker on its device runs a step: two processes
on one GPU without MPS are time-sliced, so while both have work each gets about half the
device. An assumption: no run has measured it (the one-GPU PD pair's runs in docs/benchmarks.md,
"The three modes through the whole system, one H100", time its steps only as a whole)."""


@dataclass(frozen=True)
class ClusterShape:
    """The workers to simulate and the router's settings."""

    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    split: int = 0
    """Split workers (simulator/split.py): prefill and decode loops on one device each."""
    kv_blocks: int = 0
    """KV blocks per worker (0: the profile's; half of it for each worker of a shared device)."""
    thresholds: AdmissionThresholds = DEFAULT_THRESHOLDS
    transfer_budget_blocks: int = 4096
    """A decode worker's in-flight transfer budget (kv_transfer `max_inflight_blocks`)."""
    uncached_block_weight: float = 4.0
    """Placement's w (router `uncached_block_weight`)."""
    local_prefill: LocalPrefillPolicy = LocalPrefillPolicy.THRESHOLD
    """Placement's local-prefill policy (router `orchestrator.local_prefill.policy`); `cost`
    predicts with the simulated profile."""
    stall_weight: float = 1.0
    """The `cost` policy's weight of a stalled stream (router `local_prefill.stall_weight`)."""
    chunk_tokens: int = 0
    """Every worker's prefill chunk, tokens per step (engine `max_num_batched_tokens`; 0: the
    profile's). At most the profile's largest prefill point: a step is never extrapolated."""
    split_params: SplitParams = DEFAULT_SPLIT
    """Every split worker's partitions and slowdowns."""
    shared_device: bool = False
    """Prefill worker i and decode worker i share one device (`benchmarks goodput
    --gpu-fraction 0.5`): each has half the profile's KV pool, and a step of one that overlaps
    a step of the other runs `shared_device_slowdown` times slower (simulator/overlap.py). The
    hand-off between them is the profile's."""
    shared_device_slowdown: float = SHARED_DEVICE_SLOWDOWN
    """A shared device's step time over alone while the other worker steps."""
    prefill_tp: int = 1
    """Ranks (GPUs) of each prefill worker: the TP size of the profile it steps on."""
    decode_tp: int = 1
    """Ranks of each decode, colocated or split worker: the TP size of `Simulation`'s
    profile."""

    def __post_init__(self) -> None:
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError(f"TP sizes: must be >= 1, got {self.prefill_tp}, {self.decode_tp}")
        if self.split and self.decode_tp > 1:
            raise ValueError("--split: a split engine runs on one rank (no TP), got TP "
                             f"{self.decode_tp}")  # fmt: skip
        if self.shared_device and self.prefill_tp != self.decode_tp:
            raise ValueError("--shared-device: a pair shares its devices, so both need one TP "
                             f"size, got {self.prefill_tp} and {self.decode_tp}")  # fmt: skip
        for name in ("prefill", "decode", "colocated", "split", "chunk_tokens"):
            if getattr(self, name) < 0:
                flag = name.replace("_tokens", "").replace("_", "-")
                raise ValueError(f"--{flag}: must be >= 0, got {getattr(self, name)}")
        if self.decode + self.colocated + self.split == 0:
            raise ValueError(
                "--decode / --colocated / --split: the cluster needs a worker that decodes"
            )
        if self.shared_device:
            if self.colocated or self.split:
                raise ValueError(
                    "--shared-device: pairs a prefill and a decode worker on one device; not "
                    "with --colocated or --split (a split worker is one device already)"
                )
            if self.prefill != self.decode or self.prefill < 1:
                raise ValueError(
                    "--shared-device: one prefill worker per decode worker (pairs), got "
                    f"{self.prefill}P{self.decode}D"
                )
        if not self.shared_device_slowdown >= 1:
            raise ValueError(
                f"--shared-device-slowdown: must be >= 1, got {self.shared_device_slowdown}"
            )
