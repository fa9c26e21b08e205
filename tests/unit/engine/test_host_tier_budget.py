"""The host tier's copies through the worker's in-flight budget (kv_transfer/budget.py): an
onboard or a flush the budget refuses waits (counted as queued, deferred, then its wait),
an eviction's copy is counted past the limits, and every move gives its budget back once it
is complete (on CPU: at the next decision)."""

from __future__ import annotations

import time

import torch

from engine.kv.host_tier import HostTier
from kv_transfer.budget import OFFLOAD_LANE, ONBOARD_LANE, Candidate, InFlightBudget
from kv_transfer.config import BudgetConfig

BLOCK = (2, 2, 4)  # one block: 16 float32 = 64 bytes


def make(
    budget_blocks: int = 8, slots: int = 16, per_step: int = 4
) -> tuple[HostTier, InFlightBudget]:
    device = torch.arange(16 * 16, dtype=torch.float32).reshape(16, *BLOCK)
    tier = HostTier(slots, device, max_blocks_per_step=per_step)
    budget = InFlightBudget(BudgetConfig(budget_blocks, 1 << 30, budget_blocks, 1 << 30))
    tier.budget = budget
    return tier, budget


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_a_flush_moves_offers_within_the_budget_and_gives_it_back() -> None:
    tier, budget = make()
    for b in range(6):
        tier.offer(b, h(b))
    tier.flush()  # 4 of 6 (the per-step cap); copied at once on CPU
    assert tier.num_offloaded == 4 and budget.peer_usage(OFFLOAD_LANE)[1] == 4
    tier.flush()  # the first move is complete: its budget came back, the rest goes
    assert tier.num_offloaded == 6 and budget.peer_usage(OFFLOAD_LANE)[1] == 2
    stats = tier.stats().offload  # (reading them gives back what is complete: all, on CPU)
    assert (stats.queued_blocks, stats.inflight_blocks, stats.done_blocks) == (0, 0, 6)
    assert budget.num_blocks == 0
    assert torch.equal(tier.tensor[tier.lookup(h(5))], tier.device_kv[5])
    assert tier.stats().offload.wait_s >= 0


def test_a_flush_the_budget_refuses_leaves_the_offers_for_a_later_step() -> None:
    tier, budget = make(budget_blocks=8)
    pull = Candidate("pull", "P1", 8, 512)
    budget.acquire(pull)
    tier.offer(0, h(0))
    tier.flush()
    assert tier.num_offloaded == 0
    assert (tier.stats().offload.queued_blocks, tier.stats().offload.deferred) == (1, 1)
    budget.release(pull)
    tier.flush()
    assert tier.num_offloaded == 1 and tier.stats().offload.queued_blocks == 0


def test_a_refused_onboard_waits_counts_as_queued_and_then_records_its_wait() -> None:
    tier, budget = make(budget_blocks=8)
    tier.offer(3, h(3))
    tier.flush()
    slot = tier.lookup(h(3))
    assert slot is not None
    pull = Candidate("pull", "P1", 7, 448)
    budget.acquire(pull)
    assert not tier.try_onboard("r1", 2)
    assert not tier.try_onboard("r1", 2)  # asked again: still one deferred request
    onboard = tier.stats().onboard
    assert (onboard.queued_blocks, onboard.deferred, onboard.inflight_blocks) == (2, 1, 0)
    time.sleep(0.01)
    budget.release(pull)
    assert tier.try_onboard("r1", 1)
    tier.onboard([(slot, 9)])
    assert torch.equal(tier.device_kv[9], tier.device_kv[3])
    assert budget.peer_usage(ONBOARD_LANE)[1] == 1  # held until the next decision or read
    onboard = tier.stats().onboard
    assert onboard.queued_blocks == 0 and onboard.wait_s >= 0.01
    assert onboard.inflight_blocks == 0 and onboard.done_blocks == 1
    assert budget.peer_usage(ONBOARD_LANE) == (0, 0, 0) and budget.num_blocks == 0


def test_an_eviction_copy_is_counted_even_with_the_budget_full() -> None:
    tier, budget = make(budget_blocks=4)
    pull = Candidate("pull", "P1", 4, 256)
    budget.acquire(pull)
    tier.offer(2, h(2))
    assert tier.on_device_evict(2, h(2))  # the block is about to be overwritten: copied now
    assert tier.lookup(h(2)) is not None and budget.num_blocks == 5
    budget.release(pull)
    tier.flush()
    assert budget.num_blocks == 0


def test_a_granted_onboard_never_copied_gives_its_budget_back() -> None:
    tier, budget = make()
    assert tier.try_onboard("r1", 3)
    assert tier.try_onboard("r2", 1)  # r1's grant was never used (its admission failed)
    tier.flush()
    assert budget.peer_usage(ONBOARD_LANE)[1] == 1  # only r2's, still pending its copy
    tier.onboard([])
    tier.flush()
    assert budget.num_blocks == 0


def test_without_a_budget_every_move_is_allowed() -> None:
    device = torch.zeros(4, *BLOCK)
    tier = HostTier(4, device, max_blocks_per_step=4)
    assert tier.try_onboard("r", 100)
    assert tier.stats().onboard.deferred == 0
