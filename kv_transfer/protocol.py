"""What prefill and decode endpoints say to each other: the handshake and the notices.

Handshake (out of band; the workers carry it over Ray): the prefill endpoint produces a
`HandshakeInfo`, the decode endpoint consumes it with `add_peer`, which calls
`check_handshake` first. Only the decode side loads the other's metadata (it initiates every
read and every notice; NIXL delivers notices to an agent that never loaded the sender's).

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
from kv_transfer.errors import HandshakeError

PROTOCOL_VERSION = 1
_MAGIC = b"pdkv1"
_SEP = b"\x1f"
MAX_IDS_PER_HEARTBEAT = 256


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


_FIELD_DEFAULTS = {"tp_size": "1"}
"""Compatibility fields a pool leaves out at their default (`compat_fields`)."""


def check_handshake(
    remote: HandshakeInfo, local_compat_hash: str, local_compat_fields: str, block_nbytes: int
) -> None:
    """Refuse a peer we cannot exchange blocks with, naming what differs."""
    if remote.protocol_version != PROTOCOL_VERSION:
        raise HandshakeError(
            f"peer {remote.agent_name} (worker {remote.worker_id}) speaks kv_transfer protocol "
            f"v{remote.protocol_version}, this worker v{PROTOCOL_VERSION}"
        )
    if remote.compat_hash != local_compat_hash:
        mine = _FIELD_DEFAULTS | dict(kv.split("=", 1) for kv in local_compat_fields.split(";"))
        theirs = _FIELD_DEFAULTS | dict(kv.split("=", 1) for kv in remote.compat_fields.split(";"))
        diffs = [
            f"{k}: peer {theirs.get(k, '?')} vs local {mine.get(k, '?')}"
            for k in sorted(set(mine) | set(theirs))
            if mine.get(k) != theirs.get(k)
        ] or ["(fields equal; hash computed differently)"]
        raise HandshakeError(
            f"peer {remote.agent_name} (worker {remote.worker_id}) has an incompatible KV cache "
            f"(compat hash {remote.compat_hash} vs {local_compat_hash}): " + "; ".join(diffs)
        )
    if remote.region.block_nbytes != block_nbytes:
        raise HandshakeError(
            f"peer {remote.agent_name}: block of {remote.region.block_nbytes} bytes "
            f"vs {block_nbytes} here, with equal compat hashes"
        )
    if remote.region.num_blocks <= 0:
        raise HandshakeError(f"peer {remote.agent_name} registered no blocks")


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
