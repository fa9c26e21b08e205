"""What the multi-LoRA unit tests share (test_lora.py, test_lora_cache.py): the three PEFT
adapters they serve, the adapter cache they build, and an adapter folder with its config
edited."""

from __future__ import annotations

import json
from pathlib import Path

from lora_reference import ATTENTION, MLP, make_adapter

from engine.lora.lora_adapter import WEIGHTS_FILE
from engine.lora.lora_cache import LoraCache, LoraCacheConfig
from engine.modeling.llama import LlamaModel

ADAPTERS: dict[str, dict[str, object]] = {
    "qv8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "mlp4": {"r": 4, "lora_alpha": 8, "target_modules": MLP, "use_rslora": True},
    "all16": {"r": 16, "lora_alpha": 32, "target_modules": ATTENTION + MLP},
}


def make_cache(model: LlamaModel, **config: object) -> LoraCache:
    return LoraCache(model.cfg, LoraCacheConfig(**config), model.dtype, model.device)  # type: ignore[arg-type]


def acquire_now(cache: LoraCache, name: str) -> int:
    """Acquire, waiting for the disk read in between (what a waiting request sees over steps)."""
    for _ in range(3):
        slot = cache.acquire(name)
        if slot is not None:
            return slot
        cache.wait_for_loads(timeout=30)
    raise AssertionError(f"{name} never became resident")


def edited_copy(src: Path, dst: Path, **fields: object) -> Path:
    """A copy of an adapter folder with config fields replaced."""
    dst.mkdir()
    (dst / WEIGHTS_FILE).write_bytes((src / WEIGHTS_FILE).read_bytes())
    raw = json.loads((src / "adapter_config.json").read_text())
    raw.update(fields)
    (dst / "adapter_config.json").write_text(json.dumps(raw))
    return dst


def make_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    """The ADAPTERS made by peft on the model (seeds 0, 1, 2), name → folder under root."""
    return {
        name: make_adapter(model_dir, root / name, seed, **cfg)
        for seed, (name, cfg) in enumerate(ADAPTERS.items())
    }
