"""What prefill and decode endpoints say to each other: the handshake and the notices.

Handshake (out of band; the workers carry it over Ray): the prefill endpoint produces a
`HandshakeInfo`, the decode endpoint consumes it with `add_peer`, which calls
`check_handshake` first. Only the decode side loads the other's metadata (it initiates every
read and every notice; NIXL delivers notices to an agent that never loaded the sender's).
A worker of several ranks (tensor-parallel, pipeline-parallel, both) has one agent per rank
(`followers` beside rank 0's, in rank order: stage-major), and says how its KV is split over
them (`KVSplit`: TP size, stage bounds; a rank's own pool spec names only its stage, so the
worker passes its bounds to its endpoint); the check plans the pulls between the two splits
(kv_transfer/tp_plan.py) and refuses, naming both sides, a pair it cannot serve.

Notices (decode → prefill, NIXL notifications, one line each):

    pdkv1 \x1f done  \x1f <request_id>                  READ finished: release the lease now
    pdkv1 \x1f abort \x1f <request_id>                  decode gave up: release the lease now
    pdkv1 \x1f hb    \x1f <deadline> \x1f <id> \x1f ...  queued: keep the leases until deadline

`done` is the notification NIXL attaches to the READ itself, so it is only sent after the bytes
landed. A heartbeat asks for an absolute wall-clock deadline; the prefill side caps it at
now + `lease_max_extension_s` and never shortens a lease. Unknown, late or repeated notices are
ignored, so every notice is idempotent.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kv_transfer.backend import MemoryRegion
from kv_transfer.tp_plan import HeadPlan, KVSplit, UnsupportedSplit, plan_split
from vocabulary.transfer_errors import HandshakeError

PROTOCOL_VERSION = 1
_MAGIC = b"pdkv1"
_SEP = b"\x1f"
MAX_IDS_PER_HEARTBEAT = 256


@dataclass(frozen=True)
class RankAgent:
    """The transfer agent of one rank of a worker: what a peer loads to read its pool."""

    agent_name: str
    agent_metadata: bytes
    region: MemoryRegion


@dataclass(frozen=True)
class HandshakeInfo:
    """Everything a decode endpoint needs to pull from one prefill endpoint."""

    protocol_version: int
    compat_hash: str
    compat_fields: str  # the text the hash covers, for a readable mismatch error
    worker_id: str
    agent_name: str
    agent_metadata: bytes
    region: MemoryRegion
    split: KVSplit
    """How the worker's KV is split over its ranks (stage bounds, TP size), and its pool
    layout."""
    followers: tuple[RankAgent, ...] = ()
    """Ranks 1.. of a worker of several ranks, stage-major (rank 0 is the agent above)."""
    tier_regions: tuple[MemoryRegion, ...] = ()
    """Rank 0's regions of its other tiers (its host tier: `MemoryRegion.tier`), which
    handles may name blocks in (`KVHandle.block_tiers`)."""

    @property
    def ranks(self) -> tuple[RankAgent, ...]:
        """Every rank's agent, rank 0 first."""
        return (RankAgent(self.agent_name, self.agent_metadata, self.region), *self.followers)


def check_handshake(
    remote: HandshakeInfo,
    local_compat_hash: str,
    local_compat_fields: str,
    local_split: KVSplit,
    head_nbytes: int,
    num_segments: int,
) -> HeadPlan:
    """The plan of this worker's pulls from `remote` (kv_transfer/tp_plan.py); raises
    HandshakeError naming what differs when it cannot exchange blocks with it. `head_nbytes`:
    one KV head's part of a local block (rank 0's pool: its stage's layers); `num_segments`:
    the contiguous pieces of a local block (`KVCacheSpec.num_segments`): every region of the
    peer has as many per layer of its stage (one a block when block-first), since a read
    pairs the two sides' descriptors segment by segment."""
    peer = f"peer {remote.agent_name} (worker {remote.worker_id})"
    if remote.protocol_version != PROTOCOL_VERSION:
        raise HandshakeError(
            f"{peer} speaks kv_transfer protocol "
            f"v{remote.protocol_version}, this worker v{PROTOCOL_VERSION}"
        )
    if len(remote.ranks) != remote.split.num_ranks:
        raise HandshakeError(
            f"{peer} has {len(remote.ranks)} rank agents for {remote.split.ranks_text}"
        )
    try:
        plan = plan_split(remote.split, local_split)
    except UnsupportedSplit as e:
        raise HandshakeError(f"{peer} cannot hand KV to this worker: {e}") from None
    if remote.compat_hash != local_compat_hash:
        mine = dict(kv.split("=", 1) for kv in local_compat_fields.split(";"))
        theirs = dict(kv.split("=", 1) for kv in remote.compat_fields.split(";"))
        diffs = [
            f"{k}: peer {theirs.get(k, '?')} vs local {mine.get(k, '?')}"
            for k in sorted(set(mine) | set(theirs))
            if mine.get(k) != theirs.get(k)
        ] or ["(fields equal; hash computed differently)"]
        raise HandshakeError(
            f"{peer} has an incompatible KV cache "
            f"(compat hash {remote.compat_hash} vs {local_compat_hash}): " + "; ".join(diffs)
        )
    local_layers = len(plan.stage_layers(local_split, 0))
    unit = head_nbytes // local_layers  # one KV head's part of one layer of a block
    per_layer = num_segments // local_layers if num_segments > 1 else 0  # layer-major: 1
    local_heads = remote.split.local_heads
    for rank, agent in enumerate(remote.ranks):
        layers = len(plan.stage_layers(remote.split, remote.split.position(rank)[0]))
        if agent.region.block_nbytes != unit * layers * local_heads:
            each = f"{head_nbytes} bytes each here"  # (a head of a stage of other layers:)
            if layers != local_layers:
                each = f"of {layers} layers, {unit} bytes a head and layer here"
            raise HandshakeError(
                f"{peer}: rank {rank}'s block of {agent.region.block_nbytes} bytes holds "
                f"{local_heads} KV heads {each}, with equal compat hashes"
            )
        if agent.region.num_blocks <= 0:
            raise HandshakeError(f"{peer}: rank {rank} registered no blocks")
        segments = per_layer * layers or 1
        if agent.region.num_segments != segments:
            raise HandshakeError(
                f"{peer}: rank {rank}'s block is {agent.region.num_segments} segment(s), "
                f"{segments} here, with equal compat hashes"
            )
    for region in remote.tier_regions:
        if region.block_nbytes != remote.region.block_nbytes or region.num_blocks <= 0:
            raise HandshakeError(
                f"{peer}: its {region.tier.value} tier region has {region.num_blocks} blocks of "
                f"{region.block_nbytes} bytes (its KV pool's are {remote.region.block_nbytes})"
            )
        if region.num_segments != remote.region.num_segments:
            raise HandshakeError(
                f"{peer}: its {region.tier.value} tier region's block is "
                f"{region.num_segments} segment(s), {remote.region.num_segments} in its KV pool"
            )
    return plan


def new_agent_name(worker_id: str, role: str) -> str:
    """A NIXL agent name unique per endpoint incarnation (a restarted worker gets a new one)."""
    return f"pdkv-{role}-{worker_id}-{uuid.uuid4().hex[:8]}"


class NoticeKind(enum.Enum):
    DONE = b"done"
    ABORT = b"abort"
    HEARTBEAT = b"hb"


@dataclass(frozen=True)
class Notice:
    kind: NoticeKind
    request_ids: tuple[str, ...]
    lease_deadline: float = 0.0  # heartbeats only


def _check_id(request_id: str) -> bytes:
    raw = request_id.encode()
    if not raw or _SEP in raw:
        raise ValueError(f"request id {request_id!r} is empty or contains \\x1f")
    return raw


def encode_done(request_id: str) -> bytes:
    return _SEP.join([_MAGIC, NoticeKind.DONE.value, _check_id(request_id)])


def encode_abort(request_id: str) -> bytes:
    return _SEP.join([_MAGIC, NoticeKind.ABORT.value, _check_id(request_id)])


def encode_heartbeats(request_ids: Sequence[str], lease_deadline: float) -> Iterator[bytes]:
    """One or more heartbeat notices (at most MAX_IDS_PER_HEARTBEAT ids each)."""
    head = [_MAGIC, NoticeKind.HEARTBEAT.value, repr(float(lease_deadline)).encode()]
    for i in range(0, len(request_ids), MAX_IDS_PER_HEARTBEAT):
        chunk = request_ids[i : i + MAX_IDS_PER_HEARTBEAT]
        yield _SEP.join(head + [_check_id(r) for r in chunk])


def decode_notice(message: bytes) -> Notice | None:
    """Parse a notice; None for anything that is not one (ignored by the receiver)."""
    parts = message.split(_SEP)
    if len(parts) < 3 or parts[0] != _MAGIC:
        return None
    try:
        kind = NoticeKind(parts[1])
        if kind is NoticeKind.HEARTBEAT:
            if len(parts) < 4:
                return None
            ids = tuple(p.decode() for p in parts[3:])
            return Notice(kind, ids, float(parts[2]))
        if len(parts) != 3:
            return None
        return Notice(kind, (parts[2].decode(),))
    except (ValueError, UnicodeDecodeError):
        return None
