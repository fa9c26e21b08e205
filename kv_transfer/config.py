"""Configuration of the kv_transfer package (one frozen dataclass, with two nested parts).

Field docstrings are the CLI help; the defaults suit one machine with a few workers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class DescriptorMode(enum.Enum):
    """How a read's descriptors are built (kv_transfer/nixl_backend.py says why PREPPED)."""

    PREPPED = "prepped"  # per-block dlists prepared once per peer; NIXL merges adjacent ones
    COALESCED = "coalesced"  # one descriptor per `DescriptorRun`, built per transfer
    PER_BLOCK = "per_block"  # one descriptor per block, built per transfer (benchmark only)


@dataclass(frozen=True)
class BudgetConfig:
    """In-flight limits of one decode endpoint (what it is pulling at once)."""

    max_inflight_blocks: int = 4096
    """Blocks in flight over all peers."""
    max_inflight_bytes: int = 8 << 30
    """Bytes in flight over all peers."""
    max_inflight_blocks_per_peer: int = 2048
    """Blocks in flight from one prefill peer."""
    max_inflight_bytes_per_peer: int = 4 << 30
    """Bytes in flight from one prefill peer."""

    def __post_init__(self) -> None:
        for name in (
            "max_inflight_blocks",
            "max_inflight_bytes",
            "max_inflight_blocks_per_peer",
            "max_inflight_bytes_per_peer",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"BudgetConfig.{name} must be positive")


@dataclass(frozen=True)
class KVTransferConfig:
    """Leases, deadlines, polling and budgets of the prefill and decode endpoints."""

    budget: BudgetConfig = field(default_factory=BudgetConfig)
    lease_s: float = 10.0
    """Initial lease of handed-off prefill blocks (extended by decode heartbeats)."""
    lease_max_extension_s: float = 30.0
    """A heartbeat extends a lease to at most now + this (prefill side)."""
    reaper_interval_s: float = 0.1
    """How often the prefill endpoint frees expired leases (a timer, not work-driven)."""
    transfer_timeout_s: float = 10.0
    """Default decode deadline (queue wait + transfer) when `submit` gives none."""
    heartbeat_interval_s: float = 1.0
    """How often the decode endpoint extends the leases of its queued transfers."""
    lease_extension_s: float = 10.0
    """A decode heartbeat asks for the lease to last until now + this."""
    lease_safety_margin_s: float = 0.5
    """Decode does not start, and aborts, a read with less than this left on its lease."""
    busy_poll_s: float = 0.0002
    """Decode loop sleep while reads are in flight (adds up to this to each read's latency)."""
    notif_poll_s: float = 0.005
    """Prefill loop sleep while leases are held (completion notices arrive)."""
    idle_tick_s: float = 0.05
    """Loop sleep with nothing in flight (deadline and lease timers still run)."""
    call_timeout_s: float = 30.0
    """Longest wait for the transfer thread (agent creation, memory registration, handshake)."""
    descriptor_mode: DescriptorMode = DescriptorMode.PREPPED
    """How read descriptors are built (see kv_transfer/nixl_backend.py for the measurement)."""
    capture_telemetry: bool = False
    """Ask NIXL for per-transfer telemetry (posted descriptor counts) in outcomes."""
    nixl_progress_thread: bool = False
    """Run NIXL's own progress thread. Off: it busy-polls a core even when idle, and the
    endpoint's transfer thread already drives progress while transfers are in flight."""

    def __post_init__(self) -> None:
        if self.lease_safety_margin_s >= self.lease_s:
            raise ValueError("lease_safety_margin_s must be smaller than lease_s")
        if self.heartbeat_interval_s >= self.lease_extension_s:
            raise ValueError("heartbeat_interval_s must be smaller than lease_extension_s")
