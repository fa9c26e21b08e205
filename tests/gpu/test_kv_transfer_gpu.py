"""NIXL VRAM → VRAM between two processes (GPU machine only): two GPUs of one host where there
are two, else two processes on one GPU (the same cuda_ipc path, one device).

The prefill process owns a pool on cuda:0, this process pulls into a pool on cuda:1 (or
cuda:0) through the real endpoints. UCX_TLS / UCX_NET_DEVICES (set for CPU runs by
tests/conftest.py) are removed first, so UCX can pick cuda_ipc.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from multiprocessing.connection import Connection

import pytest
import torch

from engine.kv.kv_cache import KVCache, KVCacheSpec
from kv_transfer.decode_endpoint import DecodeEndpoint
from kv_transfer.manager import TransferOutcome, TransferState

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

SPEC = KVCacheSpec(
    num_blocks=64, num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16"
)
MODEL = "gpu-test-model"


def pattern(block_id: int, device: torch.device) -> torch.Tensor:
    numel = SPEC.block_nbytes // SPEC.element_size
    values = torch.arange(block_id * numel, (block_id + 1) * numel, device=device) % 251
    return values.to(torch.bfloat16).view(SPEC.shape[1:])


def prefill_on_gpu0(conn: Connection) -> None:
    from kv_transfer.prefill_endpoint import PrefillEndpoint

    torch.cuda.set_device(0)
    cache = KVCache(SPEC, "cuda:0")
    for b in range(SPEC.num_blocks):
        cache.tensor[b].copy_(pattern(b, cache.device))
    released: list[str] = []
    endpoint = PrefillEndpoint(cache, MODEL, "gpu-p0", lambda r, b: released.append(r))
    conn.send(endpoint.start())
    handle = endpoint.hand_off("r", [*range(8, 24), 40, 50], [], 18 * SPEC.block_size)
    conn.send(handle)
    deadline = time.time() + 30
    while not released and time.time() < deadline:
        time.sleep(0.01)
    conn.send(released)
    endpoint.close()


def test_vram_pull_between_processes_over_nixl_and_bytes_match(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decode_gpu = 1 if torch.cuda.device_count() >= 2 else 0
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=prefill_on_gpu0, args=(child_conn,), daemon=True)
    child.start()
    try:
        assert conn.poll(120), "prefill process did not start"
        info = conn.recv()
        assert info.region.mem_type == "VRAM" and info.region.device_id == 0
        handle = conn.recv()
        torch.cuda.set_device(decode_gpu)
        outcomes: queue.Queue[TransferOutcome] = queue.Queue()
        cache = KVCache(SPEC, f"cuda:{decode_gpu}")
        endpoint = DecodeEndpoint(cache, MODEL, "gpu-d0", outcomes.put, outcomes.put)
        endpoint.start()
        endpoint.add_peer(info)
        local = [*range(16), 60, 61]
        plan = endpoint.submit(handle, local)
        outcome = outcomes.get(timeout=60)
        assert outcome.state is TransferState.DONE, outcome.error
        for remote, dst in zip(plan.remote_block_ids, plan.local_block_ids, strict=True):
            assert torch.equal(cache.tensor[dst], pattern(remote, cache.device))
        assert conn.poll(30) and conn.recv() == ["r"]  # completion notice ended the lease
        endpoint.close()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
