"""Attention backends by name, imported only when chosen (flashinfer is an optional GPU extra).

`select_backend("auto", ...)` picks flashinfer on CUDA when it imports and supports the
model's shape (head_dim 64/128/256, fp16/bf16), else the torch reference; an explicit name is
honoured or fails with `BackendUnavailable` saying why.
"""

from __future__ import annotations

import importlib

import torch

from engine.attention.base import AttentionBackend, BackendUnavailable
from engine.attention.flashinfer_probe import flashinfer_unavailable_reason
from engine.kv.kv_cache import KVCache
from vocabulary.model_config import ModelConfig

_BACKENDS: dict[str, str] = {
    "torch": "engine.attention.torch_backend:TorchAttentionBackend",
    "flashinfer": "engine.attention.flashinfer_backend:FlashInferBackend",
}


def backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def backend_class(name: str) -> type[AttentionBackend]:
    """The backend class registered under `name` (imports its module)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose auto or {backend_names()}")
    module, cls = _BACKENDS[name].split(":")
    try:
        found = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise BackendUnavailable(f"attention backend {name!r} cannot be imported: {e}") from e
    assert issubclass(found, AttentionBackend)
    return found


def resolve_backend_name(
    requested: str, model_cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> str:
    """The backend name to use for `requested` ("auto", "torch" or "flashinfer")."""
    if requested == "auto":
        reason = flashinfer_unavailable_reason(model_cfg, device, dtype)
        return "flashinfer" if reason is None else "torch"
    if requested == "flashinfer":
        reason = flashinfer_unavailable_reason(model_cfg, device, dtype)
        if reason is not None:
            raise BackendUnavailable(reason)
    if requested not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {requested!r}; choose auto or {backend_names()}"
        )
    return requested


def create_backend(
    requested: str,
    model_cfg: ModelConfig,
    kv_cache: KVCache,
    compute_dtype: torch.dtype | None = None,
    decode_attention: str = "auto",
) -> AttentionBackend:
    """Build the backend `requested` ("auto", "torch", "flashinfer") for this model and pool;
    `compute_dtype` is the model's (q's), default the pool's; `decode_attention` picks the
    flashinfer backend's decode kernel (EngineConfig.decode_attention)."""
    dtype = compute_dtype or kv_cache.tensor.dtype
    name = resolve_backend_name(requested, model_cfg, kv_cache.device, dtype)
    if name == "flashinfer":
        from engine.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(model_cfg, kv_cache, compute_dtype, decode_attention)
    return backend_class(name)(model_cfg, kv_cache, compute_dtype)
