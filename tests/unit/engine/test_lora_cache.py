"""The multi-LoRA adapter cache on CPU (engine/lora/lora_cache.py), over PEFT adapters made by
`peft` on the tiny model: LRU eviction of device slots, held slots never evicted, the host LRU
(host hits vs disk reads), unregister while held deferred to the last release, a failed disk
read, and the sizes it accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_cases import acquire_now, edited_copy, make_adapters, make_cache

from engine.loading.loaders import load_model
from engine.lora.lora_adapter import WEIGHTS_FILE
from engine.lora.lora_cache import AdapterState, LoraCacheConfig, LoraLoadError, LoraNotFound
from engine.modeling.llama import LlamaModel


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("lora-cache"))


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> LlamaModel:
    return load_model(tiny_model_dir, torch.float32)


def test_more_adapters_than_slots_evict_the_least_recently_used(
    model: LlamaModel, adapters: dict[str, Path]
) -> None:
    cache = make_cache(model, max_loras=2, max_cpu_loras=3)
    for name, path in adapters.items():
        cache.register(name, path)
    assert cache.acquire("qv8") is None  # the disk read starts; the caller never waits
    assert cache.state("qv8") in (AdapterState.LOADING, AdapterState.HOST)
    assert (acquire_now(cache, "qv8"), acquire_now(cache, "mlp4")) == (0, 1)
    cache.release("qv8")
    cache.release("mlp4")
    cache.acquire("mlp4")
    cache.release("mlp4")  # mlp4 used last: qv8 is the LRU
    assert acquire_now(cache, "all16") == 0
    assert cache.slot_of("qv8") is None and cache.state("qv8") is AdapterState.HOST
    assert cache.state("all16") is AdapterState.RESIDENT
    stats = cache.stats
    assert (stats.num_disk_loads, stats.num_host_loads, stats.num_evictions) == (3, 0, 1)
    assert stats.num_resident == 2 and stats.disk_load_seconds > 0
    assert acquire_now(cache, "qv8") == 1  # from the host cache into mlp4's slot (all16 held)
    stats = cache.stats
    assert (stats.num_disk_loads, stats.num_host_loads, stats.num_evictions) == (3, 1, 2)
    assert cache.slot_of("mlp4") is None and cache.slot_of("all16") == 0


def test_held_slots_are_never_evicted(model: LlamaModel, adapters: dict[str, Path]) -> None:
    cache = make_cache(model, max_loras=1, max_cpu_loras=2)
    cache.register("qv8", adapters["qv8"])
    cache.register("mlp4", adapters["mlp4"])
    assert acquire_now(cache, "qv8") == 0
    assert cache.acquire("qv8") == 0 and cache.refs("qv8") == 2
    cache.acquire("mlp4")
    cache.wait_for_loads(timeout=30)
    for _ in range(3):
        assert cache.acquire("mlp4") is None
    assert cache.state("mlp4") is AdapterState.HOST
    cache.release("qv8")
    assert cache.acquire("mlp4") is None  # one holder left
    cache.release("qv8")
    assert cache.acquire("mlp4") == 0 and cache.stats.num_evictions == 1
    with pytest.raises(ValueError, match="not held"):
        cache.release("qv8")


def test_the_host_lru_drops_adapters_and_reads_them_again(
    model: LlamaModel, adapters: dict[str, Path]
) -> None:
    cache = make_cache(model, max_loras=1, max_cpu_loras=1)
    cache.register("qv8", adapters["qv8"])
    cache.register("mlp4", adapters["mlp4"])
    acquire_now(cache, "qv8")
    cache.release("qv8")
    acquire_now(cache, "mlp4")  # qv8's slot and host copy both go
    cache.release("mlp4")
    assert cache.state("qv8") is AdapterState.REGISTERED
    acquire_now(cache, "qv8")
    stats = cache.stats
    assert (stats.num_disk_loads, stats.num_host_loads, stats.num_host_evictions) == (3, 0, 2)


def test_unregister_while_held_is_deferred_to_the_last_release(
    model: LlamaModel, adapters: dict[str, Path]
) -> None:
    cache = make_cache(model, max_loras=1)
    cache.register("qv8", adapters["qv8"])
    slot = acquire_now(cache, "qv8")
    cache.unregister("qv8")
    assert cache.names() == () and cache.refs("qv8") == 1
    with pytest.raises(LoraNotFound, match="'qv8'"):
        cache.acquire("qv8")
    with pytest.raises(ValueError, match="still held by 1 requests"):
        cache.register("qv8", adapters["qv8"])
    cache.register("mlp4", adapters["mlp4"])
    cache.acquire("mlp4")
    cache.wait_for_loads(timeout=30)
    assert cache.acquire("mlp4") is None  # the drained adapter still holds the only slot
    cache.release("qv8")
    assert cache.acquire("mlp4") == slot and cache.stats.num_evictions == 0
    cache.register("qv8", adapters["qv8"])
    assert cache.names() == ("mlp4", "qv8")


def test_a_failed_disk_read_fails_the_acquire_until_registered_again(
    model: LlamaModel, adapters: dict[str, Path], tmp_path: Path
) -> None:
    cache = make_cache(model)
    folder = edited_copy(adapters["qv8"], tmp_path / "gone")
    cache.register("gone", folder)
    (folder / WEIGHTS_FILE).unlink()
    assert cache.acquire("gone") is None
    cache.wait_for_loads(timeout=30)
    with pytest.raises(LoraLoadError, match="'gone'"):
        cache.acquire("gone")
    assert cache.state("gone") is AdapterState.FAILED
    with pytest.raises(LoraNotFound):
        cache.acquire("never-registered")
    with pytest.raises(ValueError, match="not a directory"):
        cache.register("bad", tmp_path / "missing")
    cache.unregister("gone")
    assert cache.names() == ()


def test_cache_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoraCacheConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_loras"):
        LoraCacheConfig(max_loras=0)


# ---- GPU: the CUDA-graph decode with adapters ------------------------------------------------
