"""Host values onto the device without waiting for it."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float] | torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """`values` (numbers, or a host tensor) as a tensor on `device` without waiting for the
    device: on CUDA through a pinned buffer and a non-blocking copy (the caching host
    allocator keeps the buffer until the copy has run)."""
    if isinstance(values, torch.Tensor):
        if device.type != "cuda":
            return values.to(device=device, dtype=dtype)
        return values.to(dtype).pin_memory().to(device, non_blocking=True)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
