"""The NIXL (UCX) transfer backend: READs whole blocks of a peer's registered KV pool.

The engine's KV tensor (host memory on CPU, VRAM on GPU) is registered once; its blocks are
described to NIXL as one descriptor each, prepared once locally and once per peer
(`prep_xfer_dlist`). A read is `make_prepped_xfer` with the block indices of a
`TransferPlan`; NIXL merges indices that are adjacent on both sides into one descriptor, so a
plan's `DescriptorRun`s are exactly what is posted (checked with NIXL telemetry in the tests).

Why prepped dlists: building a read's handle from lists prepared once costs the same however
many runs the plan has (a scattered plan as little as a merged one), while `initialize_xfer`
over freshly built lists costs more with every descriptor; prepping is paid once per peer, in
`add_peer`. benchmarks/bench_kv_transfer.py times all of it (figures: docs/benchmarks.md,
"KV transfer and Redis index (CPU)"); `DescriptorMode.COALESCED` and `PER_BLOCK` remain for
that comparison. On GPU, do not set UCX_TLS: UCX picks cuda_ipc between two GPUs of one host
by itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.kv_cache import KVCache
from kv_transfer.backend import DescriptorMode, MemoryRegion, Notification, XferId, XferStatus
from kv_transfer.config import KVTransferConfig
from kv_transfer.errors import BackendError
from kv_transfer.types import TransferPlan

log = logging.getLogger(__name__)

_PEER_LOST_ERRORS = {"nixlRemoteDisconnectError"}


def import_nixl() -> tuple[Any, Any]:
    """`(nixl_agent, nixl_agent_config)` from nixl, else from nixl_cu12 / nixl_cu13."""
    errors = []
    for module in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            api = __import__(module, fromlist=["nixl_agent", "nixl_agent_config"])
            return api.nixl_agent, api.nixl_agent_config
        except ImportError as e:
            errors.append(f"{module}: {e}")
    raise BackendError("NIXL is not importable: " + "; ".join(errors))


def _backend_error(what: str, e: Exception) -> BackendError:
    name = type(e).__name__
    return BackendError(f"{what}: {name}: {e}", peer_lost=name in _PEER_LOST_ERRORS)


def _block_descs(region: MemoryRegion) -> np.ndarray:
    descs = np.empty((region.num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = region.base_address + np.arange(region.num_blocks, dtype=np.uint64) * np.uint64(
        region.block_nbytes
    )
    descs[:, 1] = region.block_nbytes
    descs[:, 2] = region.device_id
    return descs


def _run_descs(region: MemoryRegion, starts: list[int], counts: list[int]) -> np.ndarray:
    descs = np.empty((len(starts), 3), dtype=np.uint64)
    descs[:, 0] = [region.base_address + s * region.block_nbytes for s in starts]
    descs[:, 1] = [c * region.block_nbytes for c in counts]
    descs[:, 2] = region.device_id
    return descs


@dataclass
class _Peer:
    region: MemoryRegion
    metadata: bytes
    prepped: Any  # nixl_prepped_dlist_handle over the peer's blocks


@dataclass
class _Read:
    handle: Any  # nixl_xfer_handle
    posted: str  # status returned by the post: "DONE" or "PROC"


class NixlBackend:
    """A NIXL agent with the UCX backend over one `KVCache` (see module docstring)."""

    def __init__(
        self,
        agent_name: str,
        cache: KVCache,
        mode: DescriptorMode = DescriptorMode.PREPPED,
        capture_telemetry: bool = False,
        progress_thread: bool = False,
    ) -> None:
        if cache.device.type == "cuda":  # UCX needs the device's context current on this thread
            torch.cuda.set_device(cache.device)
        nixl_agent, nixl_agent_config = import_nixl()
        self.agent_name = agent_name
        self.mode = mode
        self._telemetry = capture_telemetry
        try:
            # NIXL's own progress thread busy-polls a whole core even when idle; the endpoint's
            # transfer thread drives UCX progress itself (check_xfer_state / get_new_notifs)
            # while work is in flight, so it stays off unless asked for.
            config = nixl_agent_config(
                enable_prog_thread=progress_thread,
                backends=["UCX"],
                capture_telemetry=capture_telemetry,
            )
            self._agent = nixl_agent(agent_name, config)
        except Exception as e:
            raise _backend_error("creating the NIXL agent", e) from e
        if "UCX" not in self._agent.backends:
            raise BackendError(
                f"NIXL has no UCX backend (plugins: {self._agent.get_plugin_list()}); "
                "check the nixl wheel and UCX_TLS (it must include tcp on CPU)"
            )
        self._region = MemoryRegion(
            mem_type="VRAM" if cache.device.type == "cuda" else "DRAM",
            device_id=cache.device.index or 0,
            base_address=cache.tensor.data_ptr(),
            block_nbytes=cache.spec.block_nbytes,
            num_blocks=cache.spec.num_blocks,
        )
        try:
            self._registered = self._agent.register_memory(cache.tensor)
            self._local = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", _block_descs(self._region), self._region.mem_type
            )
        except Exception as e:
            raise _backend_error(f"registering {self._region.mem_type} KV memory", e) from e
        self._peers: dict[str, _Peer] = {}
        self._reads: dict[XferId, _Read] = {}
        self._next_id = 0

    def agent_metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def memory_region(self) -> MemoryRegion:
        return self._region

    def add_peer(self, agent_name: str, agent_metadata: bytes, region: MemoryRegion) -> None:
        known = self._peers.get(agent_name)
        if known is not None and known.metadata == agent_metadata:
            return
        if known is not None:
            self.remove_peer(agent_name)
        try:
            loaded = self._agent.add_remote_agent(agent_metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != agent_name:
                raise BackendError(f"metadata names agent {loaded!r}, expected {agent_name!r}")
            prepped = self._agent.prep_xfer_dlist(agent_name, _block_descs(region), region.mem_type)
        except BackendError:
            raise
        except Exception as e:
            raise _backend_error(f"loading peer {agent_name}", e) from e
        self._peers[agent_name] = _Peer(region, agent_metadata, prepped)

    def remove_peer(self, agent_name: str) -> None:
        peer = self._peers.pop(agent_name, None)
        if peer is None:
            return
        try:
            peer.prepped.release()
            self._agent.remove_remote_agent(agent_name)
        except Exception as e:
            raise _backend_error(f"removing peer {agent_name}", e) from e

    def start_read(self, plan: TransferPlan, notif: bytes) -> XferId:
        peer = self._peers.get(plan.peer)
        if peer is None:
            raise BackendError(f"no handshake with {plan.peer}")
        if max(plan.remote_block_ids) >= peer.region.num_blocks or min(plan.remote_block_ids) < 0:
            raise BackendError(f"{plan.request_id}: remote block id outside {plan.peer}'s pool")
        if max(plan.local_block_ids) >= self._region.num_blocks:
            raise BackendError(f"{plan.request_id}: local block id outside this pool")
        try:
            handle = self._make_read(plan, peer, notif)
        except Exception as e:
            raise _backend_error(f"preparing read {plan.request_id}", e) from e
        try:
            status = self._agent.transfer(handle)
        except Exception as e:
            self._release_quietly(handle)
            raise _backend_error(f"posting read {plan.request_id}", e) from e
        if status == "ERR":
            self._release_quietly(handle)
            raise BackendError(f"posting read {plan.request_id} returned ERR")
        self._next_id += 1
        self._reads[self._next_id] = _Read(handle, status)
        return self._next_id

    def _make_read(self, plan: TransferPlan, peer: _Peer, notif: bytes) -> Any:
        if self.mode is DescriptorMode.PREPPED:
            local = np.asarray(plan.local_block_ids, dtype=np.int32)
            remote = np.asarray(plan.remote_block_ids, dtype=np.int32)
            return self._agent.make_prepped_xfer(
                "READ", self._local, local, peer.prepped, remote, notif
            )
        if self.mode is DescriptorMode.COALESCED:
            counts = [r.num_blocks for r in plan.runs]
            local_d = _run_descs(self._region, [r.local_start for r in plan.runs], counts)
            remote_d = _run_descs(peer.region, [r.remote_start for r in plan.runs], counts)
        else:
            ones = [1] * plan.num_blocks
            local_d = _run_descs(self._region, list(plan.local_block_ids), ones)
            remote_d = _run_descs(peer.region, list(plan.remote_block_ids), ones)
        local_x = self._agent.get_xfer_descs(local_d, self._region.mem_type)
        remote_x = self._agent.get_xfer_descs(remote_d, peer.region.mem_type)
        return self._agent.initialize_xfer("READ", local_x, remote_x, plan.peer, notif)

    def poll(self, xfer: XferId) -> XferStatus:
        read = self._reads[xfer]
        if read.posted == "DONE":
            return XferStatus.DONE
        try:
            status = self._agent.check_xfer_state(read.handle)
        except Exception as e:
            raise _backend_error("polling a read", e) from e
        if status == "DONE":
            return XferStatus.DONE
        return XferStatus.IN_PROGRESS if status == "PROC" else XferStatus.FAILED

    def descriptor_count(self, xfer: XferId) -> int | None:
        if not self._telemetry:
            return None
        try:
            return int(self._agent.get_xfer_telemetry(self._reads[xfer].handle).descCount)
        except Exception:
            return None

    def release(self, xfer: XferId) -> None:
        read = self._reads.pop(xfer, None)
        if read is not None:
            self._release_quietly(read.handle)

    def abort(self, xfer: XferId) -> bool:
        read = self._reads.get(xfer)
        if read is None:
            return True
        try:
            read.handle.release()  # NIXL cancels an active request, or raises if it cannot
            del self._reads[xfer]
            return True
        except Exception as e:
            log.warning("aborting a read: %s: %s", type(e).__name__, e)
            return False

    def _release_quietly(self, handle: Any) -> None:
        try:
            handle.release()
        except Exception as e:
            log.warning("releasing a read handle: %s: %s", type(e).__name__, e)

    def send_notif(self, agent_name: str, message: bytes) -> None:
        try:
            self._agent.send_notif(agent_name, message)
        except Exception as e:
            raise _backend_error(f"notifying {agent_name}", e) from e

    def get_notifs(self) -> list[Notification]:
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as e:
            raise _backend_error("reading notifications", e) from e
        out: list[Notification] = []
        for name, messages in notifs.items():
            agent = name.decode() if isinstance(name, bytes) else str(name)
            out.extend(Notification(agent, bytes(m)) for m in messages)
        return out

    def close(self) -> None:
        for xfer in list(self._reads):
            if not self.abort(xfer):
                log.error("closing %s with a read that could not be aborted", self.agent_name)
        for name in list(self._peers):
            try:
                self.remove_peer(name)
            except BackendError as e:
                log.warning("%s", e)
        try:
            self._local.release()
            self._agent.deregister_memory(self._registered)
        except Exception as e:
            log.warning("closing NIXL agent %s: %s: %s", self.agent_name, type(e).__name__, e)


def nixl_backend_factory(agent_name: str, cache: KVCache, config: KVTransferConfig) -> NixlBackend:
    """The production `BackendFactory`."""
    return NixlBackend(
        agent_name,
        cache,
        config.descriptor_mode,
        config.capture_telemetry,
        config.nixl_progress_thread,
    )
