"""kv_transfer: prefill → decode KV hand-off over NIXL, and the Redis prefix-cache index.

    types.py             KVHandle, TransferPlan, PrefixMatch, TransferLoad, compat_hash
    errors.py            TransferError and its typed subclasses
    config.py            KVTransferConfig (budget, leases, deadlines, polling, index)
    plan.py              KVHandle + destination blocks → TransferPlan (coalesced runs)
    protocol.py          HandshakeInfo and the decode → prefill notices (done/abort/heartbeat)
    backend.py           the TransferBackend contract; nixl_backend.py is the real one
    budget.py            in-flight budget: FCFS admission over block counts, per peer
    manager.py           decode-side state machine (queued → transferring → done|failed|expired)
    leases.py            prefill-side leases (held → released|aborted|expired)
    agent_loop.py        the one thread that owns an agent
    prefill_endpoint.py  PrefillEndpoint: hand_off, leases, reaper, release_blocks callback
    decode_endpoint.py   DecodeEndpoint: add_peer, submit, on_done / on_failed, load
    prefix_index.py      PrefixIndex: longest cached prefix per live worker (one round trip)
    kv_publisher.py      KVEventPublisher: worker KV events → Redis, resync on gap/restart

Re-exports are lazy: the router imports the index and the types and must not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "KVHandle": "kv_transfer.types",
    "TransferPlan": "kv_transfer.types",
    "DescriptorRun": "kv_transfer.types",
    "PrefixMatch": "kv_transfer.types",
    "WorkerPrefix": "kv_transfer.types",
    "TransferLoad": "kv_transfer.types",
    "PeerLoad": "kv_transfer.types",
    "compat_hash": "kv_transfer.types",
    "TransferError": "kv_transfer.errors",
    "TransferTimeout": "kv_transfer.errors",
    "HandshakeError": "kv_transfer.errors",
    "LeaseExpired": "kv_transfer.errors",
    "UnknownPeer": "kv_transfer.errors",
    "PeerLost": "kv_transfer.errors",
    "TransferCancelled": "kv_transfer.errors",
    "KVTransferConfig": "kv_transfer.config",
    "BudgetConfig": "kv_transfer.config",
    "PrefixIndexConfig": "kv_transfer.config",
    "HandshakeInfo": "kv_transfer.protocol",
    "TransferState": "kv_transfer.manager",
    "TransferOutcome": "kv_transfer.manager",
    "TransferStats": "kv_transfer.metrics",
    "LeaseStats": "kv_transfer.leases",
    "PrefillEndpoint": "kv_transfer.prefill_endpoint",
    "DecodeEndpoint": "kv_transfer.decode_endpoint",
    "PrefixIndex": "kv_transfer.prefix_index",
    "KVEventPublisher": "kv_transfer.kv_publisher",
}

__all__ = [
    "BudgetConfig",
    "DecodeEndpoint",
    "DescriptorRun",
    "HandshakeError",
    "HandshakeInfo",
    "KVEventPublisher",
    "KVHandle",
    "KVTransferConfig",
    "LeaseExpired",
    "LeaseStats",
    "PeerLoad",
    "PeerLost",
    "PrefillEndpoint",
    "PrefixIndex",
    "PrefixIndexConfig",
    "PrefixMatch",
    "TransferCancelled",
    "TransferError",
    "TransferLoad",
    "TransferOutcome",
    "TransferPlan",
    "TransferState",
    "TransferStats",
    "TransferTimeout",
    "UnknownPeer",
    "WorkerPrefix",
    "compat_hash",
]

if TYPE_CHECKING:
    from kv_transfer.config import BudgetConfig, KVTransferConfig, PrefixIndexConfig
    from kv_transfer.decode_endpoint import DecodeEndpoint
    from kv_transfer.errors import (
        HandshakeError,
        LeaseExpired,
        PeerLost,
        TransferCancelled,
        TransferError,
        TransferTimeout,
        UnknownPeer,
    )
    from kv_transfer.kv_publisher import KVEventPublisher
    from kv_transfer.leases import LeaseStats
    from kv_transfer.manager import TransferOutcome, TransferState
    from kv_transfer.metrics import TransferStats
    from kv_transfer.prefill_endpoint import PrefillEndpoint
    from kv_transfer.prefix_index import PrefixIndex
    from kv_transfer.protocol import HandshakeInfo
    from kv_transfer.types import (
        DescriptorRun,
        KVHandle,
        PeerLoad,
        PrefixMatch,
        TransferLoad,
        TransferPlan,
        WorkerPrefix,
        compat_hash,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
