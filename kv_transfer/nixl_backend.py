"""The NIXL (UCX) transfer backend: READs whole blocks of a peer's registered KV pool.

The engine's KV tensor (host memory on CPU, VRAM on GPU) is registered once; its blocks are
described to NIXL as one descriptor per segment each (`MemoryRegion`: one segment a block in a
block-first pool, one per layer in a layer-major one), prepared once locally and once per
peer (`prep_xfer_dlist`). A read is `make_prepped_xfer` with the indices of a `TransferPlan`'s
blocks, segment by segment on both sides (the pools may differ in size, never in segments:
the handshake checks it); NIXL merges indices that are adjacent on both sides into one
descriptor, so what is posted is a plan's `DescriptorRun`s once per segment (checked with
NIXL telemetry in the tests).

Why prepped dlists: building a read's handle from lists prepared once costs the same however
many runs the plan has (a scattered plan as little as a merged one), while `initialize_xfer`
over freshly built lists costs more with every descriptor; prepping is paid once per peer, in
`add_peer`. The kv_transfer benchmark times all of it (docs/benchmarks.md, "KV transfer");
`DescriptorMode.COALESCED` and `PER_BLOCK` remain for that comparison. On GPU, do not set
UCX_TLS: UCX picks cuda_ipc between two GPUs of one host by itself. Its GET over cuda_ipc (a
READ) is off by default where UCX finds no NVLink, which includes two workers on one GPU (the
one-GPU PD pair); a GPU backend sets `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y` unless the environment
sets it (`python -m benchmarks kv_transfer --gpu --same-device` measures both).

Tier regions: a prefill agent also registers its host tier (`register_tier`: pinned host
memory on GPU, one registration, like the pool) and publishes it in the handshake; a decode
agent preps one per-block dlist per region of the peer in `add_peer`. A plan whose blocks sit
in more than one region (`TransferPlan.remote_tiers`) posts one read per region, and its
notice is sent once all are DONE, as for slices below.

Slices (a plan's `SliceRead`s, between workers of several ranks: tensor-, pipeline-parallel):
each slice is a read of its own (NIXL reads one remote agent at a time); a slice of whole
segments (a whole block-first block, or a stage's layers of a layer-major block: a run of its
segments, paired with the other side's from another segment on) goes through the per-block
dlists as above, with the indices of those segments only, a partial one (a head range of
every block of a head-major pool, a stage's layers of a block-major one) through dlists of
that byte range of every block, prepared once per (agent, range) at first use. A read of
several slices is DONE when all are; its notice is sent on its own after that (never attached
to one slice: the lease must outlive every slice), and when one slice fails the others are
cancelled before the read reports FAILED.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from engine.kv.kv_cache import KVCache
from kv_transfer.backend import MemoryRegion, Notification, XferId, XferStatus, kv_region
from kv_transfer.config import DescriptorMode, KVTransferConfig
from kv_transfer.types import SliceRead, TransferPlan
from vocabulary.kv_events import KVTier
from vocabulary.transfer_errors import BackendError

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
    """Every segment of every block of `region`, segment s of block b at index
    `s * num_blocks + b` (one entry per block with one segment): `_run_descs` with a run of
    one at every block."""
    n = region.num_blocks
    return _run_descs(region, np.arange(n), np.ones(n, dtype=np.uint64))


def _block_indices(
    region: MemoryRegion, block_ids: Sequence[int], segments: range | None = None
) -> np.ndarray:
    """The indices of `block_ids` in `_block_descs(region)`: segment by segment (`segments`
    of each block, default all), each in the order given, so two regions' indices of a plan's
    remote and local ids pair up."""
    ids = np.asarray(block_ids, dtype=np.int32)
    which = np.arange(region.num_segments, dtype=np.int32)[_pick(segments)]
    return (which[:, None] * np.int32(region.num_blocks) + ids[None, :]).ravel()


def _run_descs(
    region: MemoryRegion,
    starts: Sequence[int] | np.ndarray,
    counts: Sequence[int] | np.ndarray,
    segments: range | None = None,
) -> np.ndarray:
    """One descriptor per (segment, run of `counts[i]` blocks from `starts[i]`), segment by
    segment (`segments` of each block, default all): the same order for the local and the
    remote region of a read."""
    seg = region.segment_nbytes
    which = np.arange(region.num_segments, dtype=np.uint64)[_pick(segments)]
    segments_at = which * np.uint64(region.segment_stride)
    offsets = np.asarray(starts, dtype=np.uint64) * np.uint64(seg)
    descs = np.empty((len(which) * len(starts), 3), dtype=np.uint64)
    descs[:, 0] = (np.uint64(region.base_address) + segments_at[:, None] + offsets[None, :]).ravel()
    descs[:, 1] = np.tile(np.asarray(counts, dtype=np.uint64) * np.uint64(seg), len(which))
    descs[:, 2] = region.device_id
    return descs


def _pick(segments: range | None) -> slice:
    return slice(None) if segments is None else slice(segments.start, segments.stop)


def _segments_of(region: MemoryRegion, offset: int, nbytes: int) -> range:
    """The segments of a block that bytes [offset, offset + nbytes) are (a `whole` slice)."""
    seg = region.segment_nbytes
    first, count = divmod(offset, seg)[0], nbytes // seg
    if offset % seg or nbytes % seg or not 0 <= first < first + count <= region.num_segments:
        raise BackendError(
            f"bytes [{offset}, {offset + nbytes}) of a block are not whole segments of "
            f"{seg} bytes ({region.num_segments} a block)"
        )
    return range(first, first + count)


def _range_descs(region: MemoryRegion, blocks: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
    """Bytes [offset, offset + nbytes) of each of `blocks`, one descriptor each; only for a
    region whose block is one segment (a head range of a head-major pool)."""
    if region.num_segments != 1:
        raise BackendError(
            f"a byte range of a block is one region only where the block is: this "
            f"{region.tier.value} region has {region.num_segments} segments a block "
            "(head slices need head_major_v1 on both sides)"
        )
    descs = np.empty((len(blocks), 3), dtype=np.uint64)
    descs[:, 0] = region.base_address + blocks.astype(np.uint64) * np.uint64(region.block_nbytes)
    descs[:, 0] += np.uint64(offset)
    descs[:, 1] = nbytes
    descs[:, 2] = region.device_id
    return descs


@dataclass
class _Peer:
    region: MemoryRegion
    metadata: bytes
    prepped: Any  # nixl_prepped_dlist_handle over the peer's blocks
    ranges: dict[tuple[int, int], Any]  # (offset, nbytes) -> prepped dlist of that range
    tiers: dict[KVTier, _Peer] = field(default_factory=dict)
    """The peer's other tiers' regions (its host tier), each with its prepped dlist."""


@dataclass
class _Part:
    handle: Any  # nixl_xfer_handle
    posted: str  # status returned by the post: "DONE" or "PROC"
    done: bool = False


@dataclass
class _Read:
    parts: list[_Part]
    notify: tuple[str, bytes] | None = None  # (agent, notice) to send once every part is DONE
    failed: str = ""  # a part failed: the rest are being cancelled


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
            torch.cuda.set_device(cache.tensor.device)  # indexed, even for a pool on "cuda"
            # a READ is a GET, and UCX turns cuda_ipc's GET off where it sees no NVLink: two
            # workers on one GPU (or on PCIe-only GPUs) would read each other over TCP
            os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
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
        self._block_dim = cache.spec.block_dim
        self._region = kv_region(cache.tensor, self._block_dim)
        try:
            self._registered = self._agent.register_memory(cache.tensor)
            self._local = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", _block_descs(self._region), self._region.mem_type
            )
        except Exception as e:
            raise _backend_error(f"registering {self._region.mem_type} KV memory", e) from e
        self._peers: dict[str, _Peer] = {}
        self._tier_regions: list[tuple[MemoryRegion, Any]] = []  # (region, registration)
        self._local_ranges: dict[tuple[int, int], Any] = {}
        self._reads: dict[XferId, _Read] = {}
        self._next_id = 0

    def agent_metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def memory_region(self) -> MemoryRegion:
        return self._region

    def register_tier(self, tensor: torch.Tensor, tier: KVTier) -> MemoryRegion:
        """Register another tier's blocks (the host tier: pinned host memory on GPU) once, so
        peers read them where they are, with no copy through the device pool. The tensor has
        the pool's layout (engine/kv/host_tier.py), so its blocks have the pool's segments."""
        region = kv_region(tensor, self._block_dim, tier)
        try:
            self._tier_regions.append((region, self._agent.register_memory(tensor)))
        except Exception as e:
            raise _backend_error(f"registering the {tier.value} tier's memory", e) from e
        return region

    def add_peer(
        self,
        agent_name: str,
        agent_metadata: bytes,
        region: MemoryRegion,
        tier_regions: Sequence[MemoryRegion] = (),
    ) -> None:
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
            peer = _Peer(region, agent_metadata, prepped, {})
            for r in tier_regions:  # one prepped dlist per region, like the KV pool's
                dlist = self._agent.prep_xfer_dlist(agent_name, _block_descs(r), r.mem_type)
                peer.tiers[r.tier] = _Peer(r, agent_metadata, dlist, {})
        except BackendError:
            raise
        except Exception as e:
            raise _backend_error(f"loading peer {agent_name}", e) from e
        self._peers[agent_name] = peer

    def remove_peer(self, agent_name: str) -> None:
        peer = self._peers.pop(agent_name, None)
        if peer is None:
            return
        try:
            for dlist in peer.ranges.values():
                dlist.release()
            for tier in peer.tiers.values():
                tier.prepped.release()
            peer.prepped.release()
            self._agent.remove_remote_agent(agent_name)
        except Exception as e:
            raise _backend_error(f"removing peer {agent_name}", e) from e

    def start_read(self, plan: TransferPlan, notif: bytes) -> XferId:
        if plan.slices:
            return self._start_slices(plan, notif)
        if plan.remote_tiers:
            return self._start_tiers(plan, notif)
        peer = self._checked_peer(plan, plan.peer)
        part = self._post(plan, self._make_read, plan, peer, notif)
        self._next_id += 1
        self._reads[self._next_id] = _Read([part])
        return self._next_id

    def _start_tiers(self, plan: TransferPlan, notif: bytes) -> XferId:
        """One read per region of the peer the plan's blocks are in (its KV pool, its host
        tier); with more than one, the notice goes once all are DONE (as for slices)."""
        pieces = plan.by_tier()
        attached = notif if len(pieces) == 1 else b""
        posts = (
            lambda tier=tier, piece=piece: self._post(
                plan, self._make_read, piece, self._checked_peer(piece, plan.peer, tier), attached
            )
            for tier, piece in pieces
        )
        return self._read_of(posts, (plan.peer, notif) if notif and len(pieces) > 1 else None)

    def _start_slices(self, plan: TransferPlan, notif: bytes) -> XferId:
        posts = (
            lambda s=s: self._post(
                plan, self._make_slice_read, plan, s, self._checked_peer(plan, s.peer)
            )
            for s in plan.slices
        )
        return self._read_of(posts, (plan.peer, notif) if notif else None)

    def _read_of(
        self, posts: Iterable[Callable[[], _Part]], notify: tuple[str, bytes] | None
    ) -> XferId:
        """A read made of the parts `posts` post, in order; where one fails, the ones
        already posted are released and the error goes on. `notify`: (peer, notice) to send
        once every part is DONE."""
        parts: list[_Part] = []
        try:
            for post in posts:
                parts.append(post())
        except BaseException:
            for part in parts:
                self._release_quietly(part.handle)
            raise
        self._next_id += 1
        self._reads[self._next_id] = _Read(parts, notify)
        return self._next_id

    def _checked_peer(self, plan: TransferPlan, agent: str, tier: KVTier = KVTier.DEVICE) -> _Peer:
        peer = self._peers.get(agent)
        if peer is None:
            raise BackendError(f"no handshake with {agent}")
        if tier is not KVTier.DEVICE:
            if tier not in peer.tiers:
                raise BackendError(f"{plan.request_id}: {agent} registered no {tier.value} tier")
            peer = peer.tiers[tier]
        if max(plan.remote_block_ids) >= peer.region.num_blocks or min(plan.remote_block_ids) < 0:
            raise BackendError(f"{plan.request_id}: remote block id outside {agent}'s pool")
        if max(plan.local_block_ids) >= self._region.num_blocks:
            raise BackendError(f"{plan.request_id}: local block id outside this pool")
        return peer

    def _post(self, plan: TransferPlan, make: Callable[..., Any], *args: Any) -> _Part:
        """Prepare a read with `make(*args)` and post it."""
        try:
            handle = make(*args)
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
        return _Part(handle, status)

    def _make_read(
        self,
        plan: TransferPlan,
        peer: _Peer,
        notif: bytes,
        local_segments: range | None = None,
        remote_segments: range | None = None,
    ) -> Any:
        """A read of whole blocks, or of segments `local_segments` of each local block from
        `remote_segments` of each remote one (as many; default all)."""
        local_seg, remote_seg = local_segments, remote_segments
        if self.mode is DescriptorMode.PREPPED:
            local = _block_indices(self._region, plan.local_block_ids, local_seg)
            remote = _block_indices(peer.region, plan.remote_block_ids, remote_seg)
            return self._agent.make_prepped_xfer(
                "READ", self._local, local, peer.prepped, remote, notif
            )
        if self.mode is DescriptorMode.COALESCED:
            counts = [r.num_blocks for r in plan.runs]
            local_starts = [r.local_start for r in plan.runs]
            local_d = _run_descs(self._region, local_starts, counts, local_seg)
            remote_starts = [r.remote_start for r in plan.runs]
            remote_d = _run_descs(peer.region, remote_starts, counts, remote_seg)
        else:
            ones = [1] * plan.num_blocks
            local_d = _run_descs(self._region, list(plan.local_block_ids), ones, local_seg)
            remote_d = _run_descs(peer.region, list(plan.remote_block_ids), ones, remote_seg)
        local_x = self._agent.get_xfer_descs(local_d, self._region.mem_type)
        remote_x = self._agent.get_xfer_descs(remote_d, peer.region.mem_type)
        return self._agent.initialize_xfer("READ", local_x, remote_x, plan.peer, notif)

    def _make_slice_read(self, plan: TransferPlan, s: SliceRead, peer: _Peer) -> Any:
        if s.whole:  # whole segments of that rank: the per-block path, adjacent blocks merge
            local_seg = _segments_of(self._region, s.dst_offset, s.nbytes)
            remote_seg = _segments_of(peer.region, s.src_offset, s.nbytes)
            whole = replace(plan, peer=s.peer, slices=())
            return self._make_read(whole, peer, b"", local_seg, remote_seg)
        local_ids = np.asarray(plan.local_block_ids, dtype=np.int32)
        remote_ids = np.asarray(plan.remote_block_ids, dtype=np.int32)
        if self.mode is DescriptorMode.PREPPED:
            local = self._range_dlist(self._local_ranges, "NIXL_INIT_AGENT", self._region,
                                      s.dst_offset, s.nbytes)  # fmt: skip
            remote = self._range_dlist(peer.ranges, s.peer, peer.region, s.src_offset, s.nbytes)
            return self._agent.make_prepped_xfer("READ", local, local_ids, remote, remote_ids, b"")
        local_d = _range_descs(self._region, local_ids, s.dst_offset, s.nbytes)
        remote_d = _range_descs(peer.region, remote_ids, s.src_offset, s.nbytes)
        local_x = self._agent.get_xfer_descs(local_d, self._region.mem_type)
        remote_x = self._agent.get_xfer_descs(remote_d, peer.region.mem_type)
        return self._agent.initialize_xfer("READ", local_x, remote_x, s.peer, b"")

    def _range_dlist(
        self,
        cache: dict[tuple[int, int], Any],
        agent: str,
        region: MemoryRegion,
        offset: int,
        nbytes: int,
    ) -> Any:
        """The prepped dlist of bytes [offset, offset + nbytes) of every block of `region`."""
        key = (offset, nbytes)
        if key not in cache:
            blocks = np.arange(region.num_blocks, dtype=np.uint64)
            cache[key] = self._agent.prep_xfer_dlist(
                agent, _range_descs(region, blocks, offset, nbytes), region.mem_type
            )
        return cache[key]

    def poll(self, xfer: XferId) -> XferStatus:
        read = self._reads[xfer]
        for part in read.parts:
            if part.done or read.failed:
                continue
            if part.posted == "DONE":
                part.done = True
                continue
            try:
                status = self._agent.check_xfer_state(part.handle)
            except Exception as e:
                if len(read.parts) == 1:
                    raise _backend_error("polling a read", e) from e
                read.failed = f"polling a slice: {type(e).__name__}: {e}"
                continue
            if status == "DONE":
                part.done = True
            elif status != "PROC":
                read.failed = f"a slice's read reported {status}"
        if read.failed:  # the other slices may still write: cancel them before reporting
            return XferStatus.FAILED if self._cancel_parts(read) else XferStatus.IN_PROGRESS
        if not all(part.done for part in read.parts):
            return XferStatus.IN_PROGRESS
        if read.notify is not None:
            agent, message = read.notify
            read.notify = None
            try:  # best effort: the bytes are in; without it the lease expires instead
                self.send_notif(agent, message)
            except BackendError as e:
                log.warning("completion notice to %s failed: %s", agent, e)
        return XferStatus.DONE

    def _cancel_parts(self, read: _Read) -> bool:
        """Cancel every unfinished part of `read`; True once none can write any more."""
        safe = True
        for part in read.parts:
            if part.done or part.handle is None:
                continue
            try:
                part.handle.release()  # NIXL cancels an active request, or raises if it cannot
                part.handle = None
            except Exception as e:
                log.warning("cancelling a slice's read: %s: %s", type(e).__name__, e)
                safe = False
        return safe

    def descriptor_count(self, xfer: XferId) -> int | None:
        if not self._telemetry:
            return None
        try:
            return sum(
                int(self._agent.get_xfer_telemetry(p.handle).descCount)
                for p in self._reads[xfer].parts
            )
        except Exception:
            return None

    def release(self, xfer: XferId) -> None:
        read = self._reads.pop(xfer, None)
        if read is not None:
            for part in read.parts:
                if part.handle is not None:
                    self._release_quietly(part.handle)

    def abort(self, xfer: XferId) -> bool:
        read = self._reads.get(xfer)
        if read is None:
            return True
        for part in read.parts:
            if part.handle is None:
                continue
            try:
                part.handle.release()  # NIXL cancels an active request, or raises if it cannot
                part.handle = None
            except Exception as e:
                log.warning("aborting a read: %s: %s", type(e).__name__, e)
                return False
        del self._reads[xfer]
        return True

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
            for dlist in self._local_ranges.values():
                dlist.release()
            self._local.release()
            for _, registered in self._tier_regions:
                self._agent.deregister_memory(registered)
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
