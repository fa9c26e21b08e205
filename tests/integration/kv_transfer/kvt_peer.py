"""Peer processes for the two-process NIXL tests, and TEST-ONLY fault-injecting backends.

A peer runs one real endpoint (NIXL over UCX on CPU) in its own process (multiprocessing
"spawn") and obeys commands sent over a pipe, so the test process can hold the other side,
read what happened, and kill the peer with SIGKILL mid-transfer.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
from tp_ranks import rank_context

from engine.kv.kv_cache import LAYER_MAJOR, KVCache, KVCacheSpec
from kv_transfer.backend import XferId, XferStatus
from kv_transfer.config import KVTransferConfig
from kv_transfer.nixl_backend import NixlBackend
from kv_transfer.types import TransferPlan
from vocabulary.block_hash import BlockHash
from vocabulary.kv_events import KVTier

MODEL = "nixl-test-model"
SMALL = KVCacheSpec(
    num_blocks=64, num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype="float32"
)
LAYERED = KVCacheSpec(
    num_blocks=64, num_layers=3, block_size=16, num_kv_heads=2, head_dim=16, dtype="float32",
    layout=LAYER_MAJOR,
)  # fmt: skip
"""A layer-major pool: a block is 3 segments (one per layer) of 4 KiB, 256 KiB apart."""
# 128 KiB blocks, 16 per request (2 MiB): the kill tests pull 12 requests one at a time.
LARGE = KVCacheSpec(
    num_blocks=256, num_layers=1, block_size=16, num_kv_heads=8, head_dim=128, dtype="float32"
)


HOST_BLOCKS = 32
"""The prefill peer's host tier: blocks filled from seed 2 (its pool's from seed 1)."""


def fill(cache: KVCache, seed: int) -> None:
    """Deterministic, different in every block: block b starts with seed * 1e6 + b * 1e3 (its
    first layer's first K; every layer of it differs from the others)."""
    spec = cache.spec
    by_block = cache.tensor.movedim(spec.block_dim, 0)  # [blocks, layers, ...] in any layout
    per_block = by_block[0].numel()
    blocks = torch.arange(spec.num_blocks, dtype=torch.float32)[:, None]
    index = torch.arange(per_block, dtype=torch.float32)[None, :]
    by_block.copy_((seed * 1e6 + blocks * 1e3 + index % 997).view(by_block.shape))


# ---- fault injection (test-only) -----------------------------------------------------------


class DroppedNoticeBackend(NixlBackend):
    """Reads complete, but the completion notice never reaches the prefill side."""

    def start_read(self, plan: TransferPlan, notif: bytes) -> XferId:
        return super().start_read(plan, b"")


class LostCompletionBackend(NixlBackend):
    """The read's completion is never observed by the decode side (poll stays in progress)."""

    def poll(self, xfer: XferId) -> XferStatus:
        super().poll(xfer)
        return XferStatus.IN_PROGRESS


class SlowStartBackend(NixlBackend):
    """Every read starts 50 ms late, so a peer killed after the first read finds work left."""

    def start_read(self, plan: TransferPlan, notif: bytes) -> XferId:
        time.sleep(0.05)
        return super().start_read(plan, notif)


def backend_factory(kind: str) -> Callable[[str, KVCache, KVTransferConfig], NixlBackend]:
    classes = {
        "nixl": NixlBackend,
        "drop": DroppedNoticeBackend,
        "lost": LostCompletionBackend,
        "slow": SlowStartBackend,
    }
    cls = classes[kind]

    def make(agent_name: str, cache: KVCache, config: KVTransferConfig) -> NixlBackend:
        return cls(agent_name, cache, config.descriptor_mode, config.capture_telemetry)

    return make


# ---- peer processes -------------------------------------------------------------------------


@dataclass(frozen=True)
class Released:
    request_id: str
    block_ids: tuple[int, ...]
    at: float  # time.time()


def prefill_main(conn: Connection, spec: KVCacheSpec, config: KVTransferConfig) -> None:
    """A prefill endpoint: answers hand_off / released / stats / pinned / exit."""
    from kv_transfer.prefill_endpoint import PrefillEndpoint

    cache = KVCache(spec)
    fill(cache, seed=1)
    # the host tier's blocks, in the pool's layout (as engine/kv/host_tier.py allocates them)
    host = KVCache(dataclasses.replace(spec, num_blocks=HOST_BLOCKS))
    fill(host, seed=2)
    released: list[Released] = []
    lock = threading.Lock()

    def release(rid: str, blocks: tuple[int, ...]) -> None:
        with lock:
            released.append(Released(rid, blocks, time.time()))

    tiers = {KVTier.HOST: host.tensor}
    endpoint = PrefillEndpoint(cache, MODEL, "p0", release, config, tiers=tiers)
    conn.send(endpoint.start())
    while True:
        cmd, *args = conn.recv()
        if cmd == "hand_off":  # rid, blocks, lease_s[, block tiers]
            rid, blocks, lease_s, *more = args
            hashes = [BlockHash(b.to_bytes(16, "little")) for b in blocks]  # all blocks full
            n = len(blocks) * spec.block_size
            conn.send(endpoint.hand_off(rid, blocks, hashes, n, lease_s, *more))
        elif cmd == "released":
            with lock:
                conn.send(list(released))
        elif cmd == "stats":
            conn.send((endpoint.stats(), endpoint.pinned_block_ids()))
        elif cmd == "exit":
            endpoint.close()
            conn.send("bye")
            return


def decode_main(conn: Connection, spec: KVCacheSpec, config: KVTransferConfig) -> None:
    """A decode endpoint (slow-starting reads): add_peer, pull every handle it is sent."""
    from kv_transfer.decode_endpoint import DecodeEndpoint

    cache = KVCache(spec)
    send_lock = threading.Lock()

    def report(outcome: Any) -> None:
        with send_lock:
            conn.send(("outcome", outcome.request_id, outcome.state.value))

    endpoint = DecodeEndpoint(cache, MODEL, "d0", report, report, config, backend_factory("slow"))
    endpoint.start()
    conn.send(("ready",))
    info = conn.recv()
    endpoint.add_peer(info)
    handles, local_ids = conn.recv()
    for handle, local in zip(handles, local_ids, strict=True):
        endpoint.submit(handle, local)
    with send_lock:
        conn.send(("submitted", len(handles)))
    while conn.recv() != "exit":
        pass


class Peer:
    """A peer process with a pipe (forked from the test process's fork server, as TP ranks
    are: tests/tp_ranks.py); `kill()` is SIGKILL."""

    def __init__(self, target: Callable[..., None], *args: object) -> None:
        ctx = rank_context()
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.process.start()

    def recv(self, timeout_s: float = 30.0) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"peer {self.process.pid} sent nothing within {timeout_s}s")
        return self.conn.recv()

    def ask(self, *command: object, timeout_s: float = 30.0) -> Any:
        self.conn.send(command)
        return self.recv(timeout_s)

    def kill(self) -> None:
        if self.process.is_alive() and self.process.pid is not None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def stop(self) -> None:
        """Ask the peer to close its endpoint (waits for its "bye"), then end the process."""
        if self.process.is_alive():
            try:
                self.conn.send(("exit",))
                if self.conn.poll(5):
                    self.conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
        self.kill()  # no need to wait for the interpreter's own teardown


def wait_released(peer: Peer, rid: str, timeout_s: float = 10.0) -> list[str]:
    """What the peer released once it released `rid` (its lease ended), within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        released = peer.ask("released")
        if rid in released:
            return list(released)
        time.sleep(0.05)
    raise AssertionError(f"the lease of {rid} was not released")
