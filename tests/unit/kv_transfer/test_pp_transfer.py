"""Hand-offs between pipeline-parallel layouts (with TP) over the loopback backend: every decode
rank ends with exactly its stage's layers of its heads of every pulled block, in every layout
a plan reads, nothing else is written, and the lease ends once.

A worker here is its ranks' pools in one process (stage-major ranks): prefill rank 0's
`PrefillEndpoint` with `RankEndpoint`s for the others, and a `DecodeEndpoint` whose backend is
a `TPBackend` over one loopback agent per rank (in a worker, the followers' parts go through
Ray to their `RankEndpoint`s)."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import pytest
import torch
from kvt_factories import MODEL, LoopbackFabric, loopback_factory
from pp_kv import blocks_of, model_kv, rank_spec, rank_values

from engine.kv.kv_cache import BLOCK_MAJOR, HEAD_MAJOR, LAYER_MAJOR, KVCache
from kv_transfer.backend import TransferBackend
from kv_transfer.config import KVTransferConfig
from kv_transfer.decode_endpoint import DecodeEndpoint
from kv_transfer.manager import TransferOutcome, TransferState
from kv_transfer.prefill_endpoint import PrefillEndpoint
from kv_transfer.rank_endpoint import RankEndpoint
from kv_transfer.tp_backend import TPBackend
from vocabulary.transfer_errors import HandshakeError

pytestmark = pytest.mark.timeout(30)

KV = model_kv(blocks=24, layers=4, page=2, heads=4, dim=2)
FAST = KVTransferConfig(
    lease_s=5.0, reaper_interval_s=0.02, idle_tick_s=0.02, heartbeat_interval_s=0.05,
    notif_poll_s=0.002,
)  # fmt: skip

Side = tuple[tuple[int, ...], int]
"""A worker's stage bounds and TP size."""


class PPPair:
    """A prefill worker and a decode worker, each `Side`, on one loopback fabric."""

    def __init__(self, fabric: LoopbackFabric, layout: str, p: Side, d: Side) -> None:
        self.released: queue.Queue[str] = queue.Queue()
        self.outcomes: queue.Queue[TransferOutcome] = queue.Queue()
        (p_bounds, p_tp), (d_bounds, d_tp) = p, d
        p_ranks = (len(p_bounds) - 1) * p_tp
        self.prefill_caches = [
            KVCache(rank_spec(KV, layout, p_bounds, p_tp, r)) for r in range(p_ranks)
        ]
        for cache in self.prefill_caches:
            cache.tensor.copy_(rank_values(KV, cache.spec))
        self.followers = [
            RankEndpoint(c, "p0", r, "prefill", FAST, loopback_factory(fabric))
            for r, c in enumerate(self.prefill_caches[1:], start=1)
        ]
        agents = [f.start() for f in self.followers]
        self.prefill = PrefillEndpoint(
            self.prefill_caches[0], MODEL, "p0", lambda rid, _: self.released.put(rid), FAST,
            loopback_factory(fabric), followers=agents, layer_bounds=p_bounds,
        )  # fmt: skip
        d_ranks = (len(d_bounds) - 1) * d_tp
        self.decode_caches = [
            KVCache(rank_spec(KV, layout, d_bounds, d_tp, r)) for r in range(d_ranks)
        ]

        def factory(name: str, cache: KVCache, config: KVTransferConfig) -> TransferBackend:
            from kvt_factories import LoopbackBackend

            ranks = [LoopbackBackend(fabric, name, cache)] + [
                LoopbackBackend(fabric, f"{name}-r{r}", c)
                for r, c in enumerate(self.decode_caches[1:], start=1)
            ]
            return TPBackend(ranks) if d_ranks > 1 else ranks[0]

        self.decode = DecodeEndpoint(
            self.decode_caches[0], MODEL, "d0", self.outcomes.put, self.outcomes.put, FAST,
            factory, layer_bounds=d_bounds,
        )  # fmt: skip
        self.info = self.prefill.start()
        self.decode.start()

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()
        for f in self.followers:
            f.close()


@pytest.fixture()
def make() -> Iterator:  # type: ignore[type-arg]
    pairs: list[PPPair] = []

    def build(layout: str, p: Side, d: Side) -> PPPair:
        pairs.append(PPPair(LoopbackFabric(), layout, p, d))
        return pairs[-1]

    yield build
    for pair in pairs:
        pair.close()


CASES = [  # (layout, prefill (bounds, TP), decode (bounds, TP), regions a block)
    (BLOCK_MAJOR, ((0, 2, 4), 1), ((0, 4), 1), 2),
    (BLOCK_MAJOR, ((0, 4), 1), ((0, 2, 4), 1), 2),
    (BLOCK_MAJOR, ((0, 1, 4), 1), ((0, 3, 4), 1), 3),
    (BLOCK_MAJOR, ((0, 2, 4), 2), ((0, 4), 2), 4),
    (BLOCK_MAJOR, ((0, 2, 4), 2), ((0, 2, 4), 2), 4),
    (LAYER_MAJOR, ((0, 2, 4), 1), ((0, 4), 1), 4),
    (LAYER_MAJOR, ((0, 1, 4), 2), ((0, 3, 4), 2), 8),
    (HEAD_MAJOR, ((0, 2, 4), 1), ((0, 4), 1), 8),
    (HEAD_MAJOR, ((0, 2, 4), 2), ((0, 4), 1), 8),
    (HEAD_MAJOR, ((0, 2, 4), 1), ((0, 4), 2), 8),
    (HEAD_MAJOR, ((0, 1, 4), 2), ((0, 2, 4), 4), 12),
]


@pytest.mark.parametrize(("layout", "p", "d", "regions"), CASES)
def test_every_decode_rank_gets_exactly_its_layers_and_heads_of_every_block(
    make, layout: str, p: Side, d: Side, regions: int
) -> None:
    pair = make(layout, p, d)
    pair.decode.add_peer(pair.info)
    assert pair.info.split.layer_bounds == (p[0] if len(p[0]) > 2 else ())
    handle = pair.prefill.hand_off("r1", [7, 8, 2], [], num_tokens=6)
    assert handle.agents == (pair.info.agent_name, *(f.agent_name for f in pair.followers))
    plan = pair.decode.submit(handle, [20, 21, 5])
    outcome = pair.outcomes.get(timeout=5)
    assert outcome.state is TransferState.DONE, outcome.error
    for r, cache in enumerate(pair.decode_caches):
        spec = cache.spec
        want = blocks_of(rank_values(KV, spec), spec, [7, 8, 2])
        assert torch.equal(blocks_of(cache.tensor, spec, [20, 21, 5]), want), f"decode rank {r}"
        others = [b for b in range(spec.num_blocks) if b not in (20, 21, 5)]
        assert not blocks_of(cache.tensor, spec, others).any()  # nothing else written
    assert pair.released.get(timeout=5) == "r1" and pair.released.empty()
    per_block = sum(c.spec.block_nbytes for c in pair.decode_caches)
    assert plan.nbytes == 3 * per_block  # every layer and head of 3 blocks, once
    pieces = sum(s.num_segments if layout == LAYER_MAJOR else 1 for s in plan.slices)
    assert pieces == regions


def test_a_block_major_pair_that_slices_heads_across_stages_is_refused(make) -> None:
    pair = make(BLOCK_MAJOR, ((0, 2, 4), 2), ((0, 4), 1))
    with pytest.raises(HandshakeError) as err:
        pair.decode.add_peer(pair.info)
    assert (
        "prefill PP=2 over 4 layers (bounds 0,2,4) x TP=2 over 4 KV heads, block_major_v1 → "
        "decode TP=1 over 4 KV heads, block_major_v1: each decode rank reads part" in str(err.value)
    )


def test_a_prefill_endpoint_needs_an_agent_for_every_stage_s_ranks() -> None:
    cache = KVCache(rank_spec(KV, BLOCK_MAJOR, (0, 2, 4), 2, 0))
    with pytest.raises(ValueError, match="1 follower agents for a worker of PP=2 x TP=2"):
        PrefillEndpoint(cache, MODEL, "p0", lambda *_: None, FAST, followers=[object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="pass the worker's layer bounds"):
        PrefillEndpoint(
            KVCache(rank_spec(KV, BLOCK_MAJOR, (0, 1, 4), 1, 0)), MODEL, "p0", lambda *_: None
        )
