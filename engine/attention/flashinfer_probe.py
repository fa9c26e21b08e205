"""Whether flashinfer can serve a model here, without importing the backend."""

from __future__ import annotations

import importlib

import torch

from vocabulary.model_config import ModelConfig

FLASHINFER_HEAD_DIMS = (64, 128, 256)


def flashinfer_unavailable_reason(
    model_cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> str | None:
    """Why flashinfer cannot serve this model here, or None when it can."""
    if device.type != "cuda":
        return f"flashinfer needs a CUDA device (got {device})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flashinfer attention runs in float16/bfloat16 (got {dtype})"
    if model_cfg.head_dim not in FLASHINFER_HEAD_DIMS:
        dims = FLASHINFER_HEAD_DIMS
        return f"flashinfer supports head_dim {dims} (model has {model_cfg.head_dim})"
    try:
        importlib.import_module("flashinfer")
    except Exception as e:  # an optional extra: any import failure means "not here"
        return f"flashinfer does not import: {e}"
    return None
