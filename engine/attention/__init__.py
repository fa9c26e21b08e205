"""Attention backends: the torch reference and flashinfer (GPU), behind `AttentionBackend`."""

from engine.attention.base import AttentionBackend, BackendUnavailable
from engine.attention.registry import backend_names, create_backend, resolve_backend_name
from engine.attention.step import (
    BatchLayout,
    StepInputs,
    StepStager,
    build_layout,
    check_bounds,
    stage_once,
)

__all__ = [
    "AttentionBackend",
    "BackendUnavailable",
    "BatchLayout",
    "StepInputs",
    "StepStager",
    "backend_names",
    "build_layout",
    "check_bounds",
    "create_backend",
    "resolve_backend_name",
    "stage_once",
]
