"""Where the quantization layers' Triton kernels may run (engine/quantization/int4_kernels.py,
int8_kernels.py): on CUDA, or anywhere under Triton's interpreter (the CPU tests)."""

from __future__ import annotations

import os

import torch


def triton_unavailable_reason(device: torch.device, kernel: str) -> str | None:
    """Why `kernel` (its name, for the message) cannot run for tensors on `device`, or None."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"{kernel} runs on CUDA (or with TRITON_INTERPRET=1)"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton does not import: {e}"
    return None
