"""The engine configuration the cluster tests run the tiny model with (the `cpu_engine` helper)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import EngineConfig


def cpu_engine(model_dir: Path, **fields: Any) -> EngineConfig:
    """The tiny model in `model_dir` on CPU: float32, torch attention, no CUDA graphs; `fields`
    set the rest (pool size, context length)."""
    return EngineConfig(
        model_dir=str(model_dir),
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        cuda_graphs=False,
        **fields,
    )
