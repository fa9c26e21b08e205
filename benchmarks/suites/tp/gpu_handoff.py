"""The hand-off part of the tp_gpu suite (benchmarks/suites/tp/gpu.py): KV hand-offs between
pipeline- and tensor-parallel layouts, every rank in its own process with its pool on its own
device, over NIXL (VRAM on GPUs: UCX picks cuda_ipc; host memory over UCX shm/tcp in a `--cpu`
run).

One pair, a prefill worker of PP x TP ranks → a decode worker of PP x TP ranks (each side a
`KVSplit`: ranks stage-major, stage s holding layers [b[s], b[s+1]), TP rank t its KV heads;
kv_transfer/tp_plan.py), every rank's pool that rank's part of the model's KV (its stage's
layers, its heads: the `KVCacheSpec` a worker's rank builds, engine/kv/kv_sizing.py) in the
layout `pdserve up` gives the pair (benchmarks/suites/tp/gpu_plan.py `HandoffPair.kv_layout`):
- prefill rank r (`PrefillRank`): rank 0 holds the `PrefillEndpoint` (leases, notices; it
  passes the worker's stage bounds), the others a `RankEndpoint` that exposes their pool, as
  in a PP / TP prefill worker;
- decode followers (`DecodeFollower`): a `RankEndpoint` that runs its rank's part of a pull
  (each layer range of its stage from the prefill stage holding it, its heads from the TP
  ranks holding them);
- decode rank 0 (`DecodeRank0`): the `DecodeEndpoint` (the transfer manager), whose backend
  is a `TPBackend` over its own NIXL agent and one `FollowerBackend` per follower. Here rank
  0 reaches a follower over a pipe (benchmarks/suites/tp/rank_rpc.py); a worker does it with
  Ray calls (worker_runtime/tp_ranks.py), which add a round trip (~0.2-1 ms) per follower per
  pull.

Every pool holds a pattern of (block, model KV head, model layer, offset) (`fill_pattern`), so
after the pulls each decode rank checks that each head and layer it holds of each pulled block
has the bytes of that head, layer and block (`count_mismatches`), whichever prefill rank they
came from. Per pair: one warm-up pull (NIXL preps its descriptor lists on first use), then
`repeats` pulls of the same blocks: prefill rank 0 `hand_off` → decode rank 0 `submit` → the
outcome → the lease released (the completion notice arrived) before the next. A pull's time
is from the manager's call of `start_read` (which posts every rank's part) to the outcome
(`Pull.read_s`), stamped here around the backend: the manager's own `transfer_s` starts once
`start_read` has returned, which leaves out whatever the post does itself (a host-memory read
over cma is done inside it: 0.7 ms "transfer" for 512 MiB read at 6 GB/s on the CPU; on GPUs,
the post's own cost). Last, one plain copy of the same bytes from prefill rank 0's device to
decode rank 0's, timed in decode rank 0's process: the reference the GB/s are read against.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

import torch

from benchmarks.suites.tp.rank_rpc import Caller, Child, RemoteError, start_child
from engine.kv.kv_cache import HEAD_MAJOR, KVCache, KVCacheSpec
from kv_transfer.backend import MemoryRegion, TransferBackend, XferId, XferStatus
from kv_transfer.config import KVTransferConfig
from kv_transfer.decode_endpoint import DecodeEndpoint
from kv_transfer.manager import TransferOutcome, TransferState
from kv_transfer.prefill_endpoint import PrefillEndpoint
from kv_transfer.protocol import HandshakeInfo, RankAgent
from kv_transfer.rank_endpoint import RankEndpoint
from kv_transfer.tp_backend import FollowerBackend, TPBackend
from kv_transfer.tp_plan import KVSplit, kv_heads_of
from kv_transfer.types import TransferPlan
from vocabulary.kv_handle import KVHandle

MODEL_ID = "bench-tp-gpu"
PATTERN_MOD = 251
"""Pattern values are integers below this: exact in bf16 (and float32)."""


@dataclass(frozen=True)
class PoolShape:
    """The model's KV shape and the prompt handed off; every rank's pool holds the prompt's
    blocks at [0, n) (prefill) or receives them at [n, 2n) (decode)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    prompt_blocks: int

    @property
    def num_blocks(self) -> int:
        return 2 * self.prompt_blocks

    def spec(self, split: KVSplit, rank: int) -> KVCacheSpec:
        """The pool of rank `rank` of a worker split as `split` (of this shape's model): its
        stage's layers, its TP rank's heads, in `split.layout`."""
        stage, tp_rank = split.position(rank)
        bounds = split.layer_bounds or (0, self.num_layers)
        heads = split.heads_of(tp_rank)
        return KVCacheSpec(
            self.num_blocks,
            bounds[stage + 1] - bounds[stage],
            self.block_size,
            len(heads),
            self.head_dim,
            self.dtype,
            layout=split.layout,
            tp_size=split.tp_size,
            tp_rank=tp_rank,
            model_kv_heads=self.num_kv_heads if split.tp_size > 1 else 0,
            pp_size=split.pp_size,
            pp_rank=stage,
            layer_start=bounds[stage],
            model_layers=self.num_layers if split.pp_size > 1 else 0,
        )


def _pattern(cache: KVCache, block: int) -> torch.Tensor:
    """Block `block` of the pool as the pattern fills it, in the pool's layout: element e of
    (K/V, token, dim) of model head h and model layer l is ((block * K + h) * L + l) * 7 + e
    mod PATTERN_MOD (K, L: the model's KV heads and layers)."""
    spec, device = cache.spec, cache.device
    heads = kv_heads_of(spec.total_kv_heads, spec.tp_size, spec.tp_rank)
    head = torch.arange(heads.start, heads.stop, dtype=torch.int64, device=device)
    first = spec.layer_start
    layer = torch.arange(first, first + spec.num_layers, dtype=torch.int64, device=device)
    base = ((block * spec.total_kv_heads + head[:, None]) * spec.total_layers + layer) * 7
    offsets = torch.arange(2 * spec.block_size * spec.head_dim, dtype=torch.int64, device=device)
    values = ((base[:, :, None] + offsets) % PATTERN_MOD).view(
        len(heads), spec.num_layers, 2, spec.block_size, spec.head_dim
    )  # [heads, layers, 2, page, dim]: a head-major block
    if spec.layout != HEAD_MAJOR:  # a block-major block, a layer-major one's layers
        values = values.permute(1, 2, 3, 0, 4)  # [layers, 2, page, heads, dim]
    return values.to(cache.tensor.dtype)


def _blocks(cache: KVCache) -> torch.Tensor:
    """The pool with block ids first (a view: writes land in the pool)."""
    return cache.tensor.movedim(cache.spec.block_dim, 0)


def fill_pattern(cache: KVCache) -> None:
    """Every block of the pool gets its heads' and layers' pattern (module docstring)."""
    blocks = _blocks(cache)
    for b in range(cache.spec.num_blocks):
        blocks[b] = _pattern(cache, b)


def count_mismatches(cache: KVCache, src_blocks: list[int], dst_blocks: list[int]) -> int:
    """Elements of `dst_blocks` that differ from the pattern of the `src_blocks` they were
    pulled from (0: every head and layer this rank holds arrived intact)."""
    blocks = _blocks(cache)
    bad = 0
    for src, dst in zip(src_blocks, dst_blocks, strict=True):
        bad += int((blocks[dst] != _pattern(cache, src)).sum())
    return bad


def _use(device: str) -> torch.device:
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    return torch.device(device)


# ---- the ranks (each built in its own process by rank_rpc) ---------------------------------


class PrefillRank:
    """One rank of the prefill worker (module docstring)."""

    def __init__(
        self, shape: PoolShape, split: KVSplit, rank: int, device: str, config: KVTransferConfig
    ) -> None:
        self.cache = KVCache(shape.spec(split, rank), _use(device))
        fill_pattern(self.cache)
        self.split = split
        self.config = config
        self.endpoint: PrefillEndpoint | None = None
        self.rank_endpoint: RankEndpoint | None = None
        self._agent: RankAgent | None = None
        self._released: set[str] = set()
        self._cond = threading.Condition()
        if rank > 0:
            self.rank_endpoint = RankEndpoint(self.cache, "p0", rank, "prefill", config)
            self._agent = self.rank_endpoint.start()

    def agent(self) -> RankAgent:
        assert self._agent is not None, "rank 0's agent is its endpoint's"
        return self._agent

    def start(self, followers: list[RankAgent]) -> HandshakeInfo:
        """Rank 0: the endpoint over this pool, listing the other ranks' agents."""
        self.endpoint = PrefillEndpoint(
            self.cache, MODEL_ID, "p0", self._release, self.config, followers=followers,
            layer_bounds=self.split.layer_bounds,
        )  # fmt: skip
        return self.endpoint.start()

    def _release(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        with self._cond:
            self._released.add(request_id)
            self._cond.notify_all()

    def hand_off(self, request_id: str, block_ids: list[int]) -> KVHandle:
        assert self.endpoint is not None
        tokens = len(block_ids) * self.cache.spec.block_size
        return self.endpoint.hand_off(request_id, block_ids, [], tokens)

    def wait_released(self, request_id: str, timeout_s: float) -> bool:
        """Whether the lease of `request_id` ended (its notice came) within `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(lambda: request_id in self._released, timeout_s)

    def close(self) -> None:
        for endpoint in (self.endpoint, self.rank_endpoint):
            if endpoint is not None:
                endpoint.close()


class DecodeFollower:
    """A decode worker's rank > 0: its pool and agent; runs its part of each pull."""

    def __init__(
        self, shape: PoolShape, split: KVSplit, rank: int, device: str, config: KVTransferConfig
    ) -> None:
        self.cache = KVCache(shape.spec(split, rank), _use(device))
        self.endpoint = RankEndpoint(self.cache, "d0", rank, "decode", config)
        self._agent = self.endpoint.start()

    def agent(self) -> RankAgent:
        return self._agent

    def add_peer(self, agent_name: str, agent_metadata: bytes, region: MemoryRegion) -> None:
        self.endpoint.add_peer(agent_name, agent_metadata, region)

    def remove_peer(self, agent_name: str) -> None:
        self.endpoint.remove_peer(agent_name)

    def read(self, plan: TransferPlan, deadline: float) -> Future[XferStatus]:
        return self.endpoint.read(plan, deadline)

    def abort(self, request_id: str) -> bool:
        return self.endpoint.abort(request_id)

    def mismatches(self, src_blocks: list[int], dst_blocks: list[int]) -> int:
        return count_mismatches(self.cache, src_blocks, dst_blocks)

    def close(self) -> None:
        self.endpoint.close()


class PipeRankLink:
    """Decode rank 0's `RankLink` to a follower in another process (kv_transfer/tp_backend.py)."""

    def __init__(self, caller: Caller, timeout_s: float) -> None:
        self.caller = caller
        self.timeout_s = timeout_s

    def add_peer(self, agent_name: str, agent_metadata: bytes, region: MemoryRegion) -> None:
        self.caller.call("add_peer", agent_name, agent_metadata, region, timeout_s=self.timeout_s)

    def remove_peer(self, agent_name: str) -> None:
        self.caller.call("remove_peer", agent_name, timeout_s=self.timeout_s)

    def read(self, plan: TransferPlan, deadline: float) -> Future[XferStatus]:
        return self.caller.submit("read", plan, deadline)

    def abort(self, request_id: str) -> bool:
        try:
            return bool(self.caller.call("abort", request_id, timeout_s=self.timeout_s))
        except RemoteError:
            return self.caller.gone  # its process is gone: nothing writes any more


@dataclass(frozen=True)
class Pull:
    """One pull as decode rank 0 saw it."""

    nbytes: int
    descriptors: int
    """What the plan posts over every decode rank."""
    rank_descriptors: tuple[int, ...]
    posted: int | None
    """Descriptors NIXL reports posted (telemetry), when decode rank 0 is the only rank."""
    read_s: float
    """From the manager's call of the backend's `start_read` (the post of every rank's part)
    to the outcome callback (the poll that saw every part done, the notice sent)."""
    transfer_s: float
    """The manager's own figure (`TransferOutcome.transfer_s`): it starts its clock once
    `start_read` has returned, so a post that does the work itself is left out."""
    wall_s: float
    """From `submit` to the outcome callback."""


class _StampedBackend:
    """A transfer backend that records when each read was handed to it (else `inner`'s)."""

    def __init__(self, inner: TransferBackend, started: dict[str, float]) -> None:
        self._inner = inner
        self._started = started

    def start_read(self, plan: TransferPlan, notif: bytes) -> XferId:
        self._started[plan.request_id] = time.perf_counter()
        return self._inner.start_read(plan, notif)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class DecodeRank0:
    """Rank 0 of the decode worker: the endpoint and the backend over every rank's agent."""

    def __init__(
        self,
        shape: PoolShape,
        split: KVSplit,
        device: str,
        config: KVTransferConfig,
        agents: list[RankAgent],
        callers: list[Caller] | None = None,
    ) -> None:
        from kv_transfer.nixl_backend import NixlBackend

        self.split = split
        self.cache = KVCache(shape.spec(split, 0), _use(device))
        self._outcomes: queue.Queue[tuple[TransferOutcome, float]] = queue.Queue()
        read_timeout = config.transfer_timeout_s + config.call_timeout_s
        links: list[TransferBackend] = [
            FollowerBackend(r, agent, PipeRankLink(c, config.call_timeout_s), read_timeout)
            for r, (agent, c) in enumerate(zip(agents, callers or [], strict=True), 1)
        ]

        self._started: dict[str, float] = {}

        def factory(name: str, cache: KVCache, cfg: KVTransferConfig) -> TransferBackend:
            rank0 = NixlBackend(name, cache, capture_telemetry=True)
            inner = TPBackend([rank0, *links]) if links else rank0
            return cast(TransferBackend, _StampedBackend(inner, self._started))

        self.endpoint = DecodeEndpoint(
            self.cache, MODEL_ID, "d0", self._outcome, self._outcome, config, factory,
            layer_bounds=split.layer_bounds,
        )  # fmt: skip
        self.endpoint.start()

    def _outcome(self, outcome: TransferOutcome) -> None:
        self._outcomes.put((outcome, time.perf_counter()))

    def add_peer(self, info: HandshakeInfo) -> None:
        self.endpoint.add_peer(info)

    def pull(self, handle: KVHandle, local_blocks: list[int], timeout_s: float) -> Pull:
        """Pull `handle` into `local_blocks`; raises unless it ends DONE within `timeout_s`."""
        t0 = time.perf_counter()
        plan = self.endpoint.submit(handle, local_blocks)
        try:
            outcome, done_at = self._outcomes.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"pull {handle.request_id}: no outcome in {timeout_s} s") from None
        if outcome.state is not TransferState.DONE:
            raise RuntimeError(f"pull {handle.request_id}: {outcome.state.value}: {outcome.error}")
        ranks = range(self.split.num_ranks) if plan.slices else range(1)
        return Pull(
            plan.nbytes,
            plan.num_descriptors,
            tuple(
                plan.for_rank(r).num_descriptors if plan.slices else plan.num_descriptors
                for r in ranks
            ),
            outcome.posted_descriptors,
            done_at - self._started.pop(handle.request_id),
            outcome.transfer_s,
            done_at - t0,
        )

    def mismatches(self, src_blocks: list[int], dst_blocks: list[int]) -> int:
        return count_mismatches(self.cache, src_blocks, dst_blocks)

    def peer_copy_s(self, src_device: str, nbytes: int, repeats: int) -> list[float]:
        """Seconds of each of `repeats` plain copies of `nbytes` from `src_device` here."""
        src = torch.full((nbytes,), 7, dtype=torch.uint8, device=src_device)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=self.cache.device)
        devices = {d for d in (src.device, dst.device) if d.type == "cuda"}
        times = []
        for i in range(repeats + 1):
            for d in devices:
                torch.cuda.synchronize(d)
            t0 = time.perf_counter()
            dst.copy_(src)
            for d in devices:
                torch.cuda.synchronize(d)
            if i:
                times.append(time.perf_counter() - t0)
        return times

    def close(self) -> None:
        self.endpoint.close()


# ---- one pair, driven from the parent ---------------------------------------------------------


@dataclass(frozen=True)
class PairResult:
    prefill: KVSplit
    decode: KVSplit
    prefill_devices: tuple[str, ...]
    decode_devices: tuple[str, ...]
    pulls: tuple[Pull, ...]
    mismatched: int
    """Elements of the pulled blocks, over every decode rank, that differ from the source."""
    peer_copy_s: tuple[float, ...]
    mem_type: str
    """The memory type prefill rank 0 registered its pool as (VRAM on GPUs)."""


def run_pair(
    shape: PoolShape,
    prefill_split: KVSplit,
    decode_split: KVSplit,
    prefill_devices: list[str],
    decode_devices: list[str],
    config: KVTransferConfig,
    repeats: int,
    timeout_s: float,
) -> PairResult:
    """One pair's processes (rank r of a side on that side's `devices[r]`), pulls and checks
    (module docstring); every wait within `timeout_s` in all. Raises RuntimeError /
    RemoteError naming what failed."""
    ctx = mp.get_context("spawn")
    p, d = len(prefill_devices), len(decode_devices)
    if (p, d) != (prefill_split.num_ranks, decode_split.num_ranks):
        raise ValueError(
            f"{p} prefill and {d} decode devices for {prefill_split.ranks_text} → "
            f"{decode_split.ranks_text}"
        )
    deadline = time.monotonic() + timeout_s
    prefill: list[Child] = []
    followers: list[Child] = []
    rank0: list[Child] = []

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"pair of {p}->{d} ranks: past its {timeout_s:g} s")
        return remaining

    try:
        for r, dev in enumerate(prefill_devices):
            args = (shape, prefill_split, r, dev, config)
            prefill.append(start_child(ctx, f"prefill-rank{r}", PrefillRank, args))
        links = [ctx.Pipe() for _ in range(d - 1)]
        for r, dev in enumerate(decode_devices[1:], 1):
            args = (shape, decode_split, r, dev, config)
            link = [links[r - 1][0]]
            followers.append(start_child(ctx, f"decode-rank{r}", DecodeFollower, args, link))
        f_calls = [f.ready(left()) for f in followers]
        agents = [c.call("agent", timeout_s=left()) for c in f_calls]
        rank0_args = (shape, decode_split, decode_devices[0], config, agents)
        calls = [b for _, b in links]
        rank0.append(start_child(ctx, "decode-rank0", DecodeRank0, rank0_args, calls=calls))
        for a, b in links:  # the children hold them now: a dead child's pipe then ends
            a.close()
            b.close()
        p_calls = [c.ready(left()) for c in prefill]
        d0 = rank0[0].ready(left())
        p_agents = [c.call("agent", timeout_s=left()) for c in p_calls[1:]]
        info = p_calls[0].call("start", p_agents, timeout_s=left())
        d0.call("add_peer", info, timeout_s=left())
        n = shape.prompt_blocks
        src, dst = list(range(n)), list(range(n, 2 * n))
        pulls = []
        for i in range(repeats + 1):
            handle = p_calls[0].call("hand_off", f"r{i}", src, timeout_s=left())
            pull = d0.call("pull", handle, dst, left(), timeout_s=left() + 1.0)
            if not p_calls[0].call("wait_released", f"r{i}", left(), timeout_s=left() + 1.0):
                raise RuntimeError(f"pull r{i}: prefill rank 0 saw no completion notice")
            if i:  # the first one warms up the prepped descriptor lists
                pulls.append(pull)
        bad = d0.call("mismatches", src, dst, timeout_s=left())
        bad += sum(c.call("mismatches", src, dst, timeout_s=left()) for c in f_calls)
        nbytes = pulls[0].nbytes if pulls else 0
        copies = d0.call("peer_copy_s", prefill_devices[0], nbytes, repeats, timeout_s=left())
        return PairResult(
            prefill_split, decode_split, tuple(prefill_devices), tuple(decode_devices),
            tuple(pulls), bad, tuple(copies), info.region.mem_type,
        )  # fmt: skip
    finally:  # the reader first: its reads end before the pools they read go
        for child in (*rank0, *followers, *prefill):
            child.stop(10.0)
