"""Hand-offs between tensor-parallel workers over the loopback backend: every decode rank ends
with exactly its KV heads of every pulled block, the lease ends only once every rank has read,
and a rank whose part fails has the others cancelled before the blocks are given back.

A TP worker here is its ranks' pools in one process: prefill rank 0's `PrefillEndpoint` with
`RankEndpoint`s for the other ranks, and a decode `DecodeEndpoint` whose backend is a
`TPBackend` over one loopback agent per rank (in a worker, the followers' parts go through
Ray to their `RankEndpoint`s: tests/integration/workers cover that).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

import pytest
import torch
from kvt_factories import MODEL, LoopbackBackend, LoopbackFabric, loopback_factory

from engine.kv.kv_cache import BLOCK_MAJOR, HEAD_MAJOR, KVCache, KVCacheSpec
from kv_transfer.backend import TransferBackend, XferStatus
from kv_transfer.config import KVTransferConfig
from kv_transfer.decode_endpoint import DecodeEndpoint
from kv_transfer.manager import TransferOutcome, TransferState
from kv_transfer.prefill_endpoint import PrefillEndpoint
from kv_transfer.rank_endpoint import RankEndpoint
from kv_transfer.tp_backend import TPBackend
from kv_transfer.tp_plan import kv_heads_of
from vocabulary.kv_handle import KVHandle
from vocabulary.transfer_errors import HandshakeError

pytestmark = pytest.mark.timeout(30)

KV_HEADS, BLOCKS = 4, 32
FAST = KVTransferConfig(
    lease_s=5.0, reaper_interval_s=0.02, idle_tick_s=0.02, heartbeat_interval_s=0.05,
    notif_poll_s=0.002,
)  # fmt: skip


def rank_spec(tp: int, rank: int, layout: str = HEAD_MAJOR) -> KVCacheSpec:
    return KVCacheSpec(
        BLOCKS, 2, 4, len(kv_heads_of(KV_HEADS, tp, rank)), 4, "float32", layout=layout,
        tp_size=tp, tp_rank=rank, model_kv_heads=KV_HEADS if tp > 1 else 0,
    )  # fmt: skip


def whole_model_kv() -> torch.Tensor:
    """Distinct values for every (block, model head, layer, K/V, token, dim): head-major."""
    n = BLOCKS * KV_HEADS * 2 * 2 * 4 * 4
    return torch.arange(n, dtype=torch.float32).reshape(BLOCKS, KV_HEADS, 2, 2, 4, 4)


class TPPair:
    """A prefill worker of TP `p` and a decode worker of TP `d` on one loopback fabric."""

    def __init__(self, fabric: LoopbackFabric, p: int, d: int, layout: str = HEAD_MAJOR) -> None:
        self.fabric = fabric
        self.released: queue.Queue[str] = queue.Queue()
        self.outcomes: queue.Queue[TransferOutcome] = queue.Queue()
        kv = whole_model_kv()
        self.prefill_caches = []
        for r in range(p):
            cache = KVCache(rank_spec(p, r, layout))
            heads = kv_heads_of(KV_HEADS, p, r)
            cache.tensor.view(-1).copy_(kv[:, heads.start : heads.stop].reshape(-1))
            self.prefill_caches.append(cache)
        self.followers = [
            RankEndpoint(c, "p0", r, "prefill", FAST, loopback_factory(fabric))
            for r, c in enumerate(self.prefill_caches[1:], start=1)
        ]
        agents = [f.start() for f in self.followers]
        self.prefill = PrefillEndpoint(
            self.prefill_caches[0], MODEL, "p0", lambda rid, _: self.released.put(rid), FAST,
            loopback_factory(fabric), followers=agents,
        )  # fmt: skip
        self.decode_caches = [KVCache(rank_spec(d, r, layout)) for r in range(d)]
        self.rank_backends: list[LoopbackBackend] = []

        def factory(name: str, cache: KVCache, config: KVTransferConfig) -> TransferBackend:
            self.rank_backends = [LoopbackBackend(fabric, name, cache)] + [
                LoopbackBackend(fabric, f"{name}-r{r}", c)
                for r, c in enumerate(self.decode_caches[1:], start=1)
            ]
            return TPBackend(self.rank_backends) if d > 1 else self.rank_backends[0]

        self.decode = DecodeEndpoint(
            self.decode_caches[0], MODEL, "d0", self.outcomes.put, self.outcomes.put, FAST,
            factory,
        )  # fmt: skip
        self.info = self.prefill.start()
        self.decode.start()

    def expected(self, rank: int, d: int, remote: list[int]) -> torch.Tensor:
        heads = kv_heads_of(KV_HEADS, d, rank)
        return whole_model_kv()[remote][:, heads.start : heads.stop]

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()
        for f in self.followers:
            f.close()


@pytest.fixture()
def fabric() -> LoopbackFabric:
    return LoopbackFabric()


@pytest.fixture()
def make(fabric: LoopbackFabric) -> Iterator:  # type: ignore[type-arg]
    pairs: list[TPPair] = []

    def build(p: int, d: int, layout: str = HEAD_MAJOR) -> TPPair:
        pairs.append(TPPair(fabric, p, d, layout))
        return pairs[-1]

    yield build
    for pair in pairs:
        pair.close()


@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1), (2, 4), (2, 2), (4, 1), (1, 1)])
def test_every_decode_rank_gets_exactly_its_heads_of_every_block(make, p: int, d: int) -> None:
    pair = make(p, d)
    pair.decode.add_peer(pair.info)
    handle = pair.prefill.hand_off("r1", [7, 8, 2], [], num_tokens=10)
    assert handle.agents == tuple([pair.info.agent_name, *(f.agent_name for f in pair.followers)])
    plan = pair.decode.submit(handle, [20, 21, 5])
    outcome = pair.outcomes.get(timeout=5)
    assert outcome.state is TransferState.DONE, outcome.error
    for r, cache in enumerate(pair.decode_caches):
        assert torch.equal(cache.tensor[[20, 21, 5]], pair.expected(r, d, [7, 8, 2]))
        others = [b for b in range(BLOCKS) if b not in (20, 21, 5)]
        assert not cache.tensor[others].any()  # nothing else written
    assert pair.released.get(timeout=5) == "r1" and pair.released.empty()
    per_block = sum(c.spec.block_nbytes for c in pair.decode_caches)
    assert plan.nbytes == 3 * per_block  # every model head of 3 blocks, once
    assert len(plan.slices) == (0 if p == d == 1 else len({s for s in plan.slices}))


def test_the_lease_ends_only_once_every_rank_has_read(make, fabric: LoopbackFabric) -> None:
    fabric.auto_complete = False
    pair = make(1, 2)
    pair.decode.add_peer(pair.info)
    pair.decode.submit(pair.prefill.hand_off("r1", [1, 2], [], num_tokens=8), [3, 4])
    wait_for(lambda: sum(len(b.reads) for b in pair.rank_backends) == 2)
    assert fabric.complete("r1")  # one rank's part
    time.sleep(0.1)
    assert pair.outcomes.empty() and pair.released.empty()
    assert fabric.complete("r1")
    assert pair.outcomes.get(timeout=5).state is TransferState.DONE
    assert pair.released.get(timeout=5) == "r1"


def test_a_rank_whose_part_fails_has_the_others_cancelled_before_the_blocks_return(
    make, fabric: LoopbackFabric
) -> None:
    fabric.auto_complete = False
    fabric.abort_fails = True  # rank 0's part cannot be cancelled yet
    pair = make(2, 2)
    pair.decode.add_peer(pair.info)
    pair.decode.submit(pair.prefill.hand_off("r1", [1, 2], [], num_tokens=8), [3, 4])
    wait_for(lambda: all(b.reads for b in pair.rank_backends))
    (read,) = pair.rank_backends[1].reads.values()
    read.status = XferStatus.FAILED
    time.sleep(0.2)
    assert pair.outcomes.empty()  # rank 0 may still write into the blocks
    assert pair.rank_backends[0].reads
    fabric.abort_fails = False
    outcome = pair.outcomes.get(timeout=5)
    assert outcome.state is TransferState.FAILED and "decode rank 1" in str(outcome.error)
    assert not pair.rank_backends[0].reads  # cancelled, then given back
    assert pair.released.get(timeout=5) == "r1"  # the abort notice ends the lease


def test_a_block_major_cross_tp_pair_is_refused_naming_both_sides(make) -> None:
    pair = make(2, 1, BLOCK_MAJOR)
    with pytest.raises(HandshakeError) as err:
        pair.decode.add_peer(pair.info)
    assert "prefill TP=2 over 4 KV heads, block_major_v1 → decode TP=1" in str(err.value)
    same = make(2, 2, BLOCK_MAJOR)  # rank r reads rank r's whole blocks: any layout
    same.decode.add_peer(same.info)


def test_a_handle_whose_ranks_are_not_the_handshake_s_is_refused(make) -> None:
    pair = make(2, 1)
    pair.decode.add_peer(pair.info)
    handle = pair.prefill.hand_off("r1", [1], [], num_tokens=4)
    stale = KVHandle(**{**handle.__dict__, "rank_agents": (handle.agent_name, "old-rank-1")})
    with pytest.raises(Exception, match="are not those of the handshake"):
        pair.decode.submit(stale, [3])


def test_a_rank_endpoint_reads_its_part_and_cancels_a_read_at_its_deadline(
    fabric: LoopbackFabric,
) -> None:
    source = KVCache(rank_spec(1, 0))
    source.tensor.copy_(whole_model_kv())
    LoopbackBackend(fabric, "P", source)
    rank = RankEndpoint(KVCache(rank_spec(2, 1)), "d0", 1, "decode", FAST, loopback_factory(fabric))
    try:
        agent = rank.start()
        assert agent.agent_name.startswith("pdkv-decode-d0-r1-")
        rank.add_peer("P", b"P", agent.region)
        pair_plan = plan_for_rank_1()
        assert rank.read(pair_plan, time.time() + 5).result(5) is XferStatus.DONE
        assert torch.equal(rank.cache.tensor[[9]], whole_model_kv()[[4]][:, 2:4])
        fabric.auto_complete = False
        late = rank.read(pair_plan, time.time() + 0.1)
        assert late.result(5) is XferStatus.FAILED  # cancelled at its deadline
        stuck = rank.read(pair_plan, time.time() + 60)
        wait_for(lambda: rank.progress().has_work)
        assert rank.abort("r") and stuck.result(5) is XferStatus.FAILED
        assert not rank.progress().has_work
    finally:
        rank.close()


def plan_for_rank_1():  # type: ignore[no-untyped-def]
    """Rank 1 of a TP=2 decode worker pulling block 4 of a one-rank prefill agent "P" into 9."""
    from kv_transfer.plan import plan_transfer, slice_reads
    from kv_transfer.tp_plan import KVSplit, plan_split

    head = rank_spec(2, 1).head_nbytes
    split = plan_split(KVSplit(1, KV_HEADS, HEAD_MAJOR), KVSplit(2, KV_HEADS, HEAD_MAJOR))
    reads = slice_reads(split, ("P",), head)
    handle = KVHandle("r", "p0", "P", (4,), (), 4, 0.0, "c")
    return plan_transfer(handle, [9], rank_spec(2, 1).block_nbytes, slices=reads).for_rank(1)


def wait_for(predicate, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)
