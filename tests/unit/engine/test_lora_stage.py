"""LoRA on a pipeline's stages (engine/lora/lora_stage.py): a stage's part of an adapter is its
layers of the whole; rank 0's cache (stage 0) logs the slots it fills, and a stage replaying
those fills holds, slot by slot, its layers of the same adapters, reading each folder once
(refills come from its host copies)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_reference import ATTENTION, MLP, make_adapter

from engine.config import EngineConfig
from engine.lora.lora_adapter import load_adapter, read_adapter_spec
from engine.lora.lora_apply import LoraWeights
from engine.lora.lora_cache import LoraCache, LoraCacheConfig, LoraFill
from engine.lora.lora_stage import StageLoras
from vocabulary.model_config import ModelConfig

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stage-lora")
    return {
        "all8": make_adapter(tiny_model_dir, root / "all8", 1, r=8, target_modules=ATTENTION + MLP),
        "mlp4": make_adapter(tiny_model_dir, root / "mlp4", 2, r=4, target_modules=MLP),
    }


def whole_slot(cfg: ModelConfig, path: Path) -> LoraWeights:
    """One slot of the whole model holding the adapter at `path`."""
    weights = LoraWeights(cfg, 1, 16, torch.float32, CPU)
    weights.fill(0, load_adapter(read_adapter_spec(path, cfg), cfg, torch.float32))
    return weights


def test_a_stages_part_of_an_adapter_is_its_layers_of_the_whole(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    spec = read_adapter_spec(adapters["all8"], cfg)
    whole = load_adapter(spec, cfg, torch.float32)
    part = load_adapter(spec, cfg, torch.float32, layers=range(2, 4))
    for module in spec.modules:
        assert torch.equal(part.a[module], whole.a[module][2:4])
        assert torch.equal(part.b[module], whole.b[module][2:4])


def test_a_stage_fills_rank_0s_slots_with_its_layers_of_the_same_adapters(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    sizes = LoraCacheConfig(max_loras=1, max_cpu_loras=2, max_lora_rank=16, kernel="torch")
    rank0 = LoraCache(cfg, sizes, torch.float32, CPU, layers=range(0, 2))
    rank0.mirror()
    config = EngineConfig(str(tiny_model_dir), max_loras=1, max_cpu_loras=2, max_lora_rank=16)
    stage = StageLoras(config, cfg, range(2, 4), torch.float32, CPU)
    for name, path in adapters.items():
        rank0.register(name, path)
    for name in ("all8", "mlp4", "all8"):  # one slot: each acquire takes it from the other
        if rank0.acquire(name) is None:
            rank0.wait_for_loads(timeout=30)
            assert rank0.acquire(name) == 0
        rank0.release(name)
        fills = rank0.take_fills()
        assert fills == (LoraFill(0, name, str(adapters[name])),)
        stage.fill(fills[0])
        whole = whole_slot(cfg, adapters[name])
        for proj, a in whole.a.items():
            assert torch.equal(rank0.weights.a[proj], a[0:2])
            assert torch.equal(stage.weights.a[proj], a[2:4])
            for got, want in zip(stage.weights.b[proj], whole.b[proj], strict=True):
                assert torch.equal(got, want[2:4])
    assert stage.num_disk_loads == 2 and rank0.take_fills() == ()
