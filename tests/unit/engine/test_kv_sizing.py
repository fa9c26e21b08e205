"""KV pool sizing on a shared GPU (engine/kv/kv_sizing.py): a worker with a share of the card
sizes from its share, so two workers at 0.5 both fit whichever starts first; a configured pool
that cannot fit is refused with the figures; a worker actor placed on a fraction of a GPU gets
that fraction as its share. The device readings are given (`DeviceMemory`): the arithmetic is
what is tested here, the GPU path in tests/gpu."""

from __future__ import annotations

import pytest

from deploy.control.worker_actors import with_memory_share
from engine.config import EngineConfig
from engine.kv.kv_sizing import DeviceMemory, check_configured_blocks, kv_budget_bytes
from vocabulary.worker_api import ActorPlacement, WorkerRole
from worker_runtime.runtime import WorkerConfig

GIB = 2**30
CARD = 80 * GIB
WEIGHTS = 16 * GIB
PEAK = 2 * GIB
BLOCK = 2 * 2**20  # one block of the Llama-3-8B shape, bf16, 16 tokens


def first_worker() -> DeviceMemory:
    """The first worker on an empty card, its weights loaded."""
    return DeviceMemory(free=CARD - WEIGHTS, total=CARD, held=WEIGHTS, peak=PEAK)


def second_worker(first_total: float) -> DeviceMemory:
    """The second worker, after the first holds `first_total` bytes and it loaded its own."""
    return DeviceMemory(free=int(CARD - first_total - WEIGHTS), total=CARD, held=WEIGHTS, peak=PEAK)


def test_whole_card_sizes_from_free_memory_as_before() -> None:
    mem = first_worker()
    assert kv_budget_bytes(mem, 0.85, 1.0) == pytest.approx(0.85 * (CARD - WEIGHTS - PEAK))


def test_two_workers_at_half_a_card_each_both_fit_whichever_starts_first() -> None:
    kv_first = kv_budget_bytes(first_worker(), 0.85, 0.5)
    assert kv_first == pytest.approx(0.85 * (CARD / 2 - WEIGHTS - PEAK))
    # what the first holds at most: weights, KV and the rest of its half for graphs/workspaces
    first_total = CARD / 2
    kv_second = kv_budget_bytes(second_worker(first_total), 0.85, 0.5)
    assert kv_second == pytest.approx(kv_first)
    assert first_total + WEIGHTS + PEAK + kv_second <= CARD
    # without shares the first takes most of the card and the second gets almost nothing
    greedy_first = WEIGHTS + PEAK + kv_budget_bytes(first_worker(), 0.85, 1.0)
    assert kv_budget_bytes(second_worker(greedy_first), 0.85, 1.0) < 0.2 * kv_first


def test_a_share_never_sizes_past_the_free_memory() -> None:
    crowded = DeviceMemory(free=10 * GIB, total=CARD, held=WEIGHTS, peak=PEAK)
    assert kv_budget_bytes(crowded, 0.85, 0.5) == pytest.approx(0.85 * 8 * GIB)
    full = DeviceMemory(free=GIB, total=CARD, held=WEIGHTS, peak=PEAK)
    assert kv_budget_bytes(full, 0.85, 0.5) == 0.0


def test_a_configured_pool_that_fits_passes_and_one_that_cannot_is_refused_with_figures() -> None:
    # issue 49: 12,000 blocks (23.4 GiB) for the second worker of a one-GPU PD pair
    second = second_worker(WEIGHTS + 12_000 * BLOCK + PEAK)
    check_configured_blocks(6_000, BLOCK, second)
    with pytest.raises(ValueError) as err:
        check_configured_blocks(12_000, BLOCK, second)
    text = str(err.value)
    assert text.startswith("num_kv_blocks: 12000 blocks need 23.44 GiB")
    fits = (second.free - second.peak) // BLOCK
    assert f"at most {fits} blocks fit" in text
    assert "GiB free of 80.00 GiB" in text and "holding 16.00 GiB" in text


def test_a_fractional_placement_becomes_the_engines_share_unless_one_is_set() -> None:
    config = WorkerConfig(
        worker_id="d0", role=WorkerRole.DECODE, engine=EngineConfig(model_dir="m")
    )
    half = ActorPlacement(num_gpus=0.5, num_cpus=1.0)
    assert with_memory_share(config, half).engine.gpu_memory_share == 0.5
    assert with_memory_share(config, ActorPlacement(num_gpus=1.0)).engine.gpu_memory_share == 1.0
    assert with_memory_share(config, ActorPlacement()).engine.gpu_memory_share == 1.0  # CPU
    own = WorkerConfig(
        worker_id="d0", role=WorkerRole.DECODE,
        engine=EngineConfig(model_dir="m", gpu_memory_share=0.4),
    )  # fmt: skip
    assert with_memory_share(own, half).engine.gpu_memory_share == 0.4


@pytest.mark.parametrize(
    "fields",
    [{"gpu_memory_share": 0.0}, {"gpu_memory_share": 1.5}, {"kv_cache_memory_fraction": 0}],
)
def test_shares_and_fractions_outside_zero_to_one_are_refused(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="kv_cache_memory_fraction and gpu_memory_share"):
        EngineConfig(model_dir="m", **fields)  # type: ignore[arg-type]
