"""Where the quantization layers' Triton kernels may run (engine/quantization/int4_kernels.py,
int8_kernels.py): on CUDA, or anywhere under Triton's interpreter (the CPU tests)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence

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


class DecidedOnce:
    """Whether a kernel may run on a device: `usable(device)` (it builds, and gives the
    numbers it must), decided once per device on the first call outside a CUDA-graph capture
    (the check synchronises; a call inside a capture before it gets False: the caller's
    fallback, whose numbers are the same)."""

    def __init__(self, usable: Callable[[torch.device], bool]) -> None:
        self._usable = usable
        self._decided: dict[torch.device, bool] = {}

    def __call__(self, device: torch.device) -> bool:
        decided = self._decided.get(device)
        if decided is not None:
            return decided
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        self._decided[device] = self._usable(device)
        return self._decided[device]


def workspace_bytes(workspaces: Mapping[torch.device, Sequence[torch.Tensor]],
                    device: torch.device) -> int:  # fmt: skip
    """Bytes of a kernel's workspace tensors (4-byte elements) on `device`."""
    have = workspaces.get(device)
    return 0 if have is None else sum(t.numel() * 4 for t in have)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors a split-K kernel fills on `device` (under the interpreter a
    few, so the CPU tests run the split-K branch)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def fill_split(tiles: int, most: int, device: torch.device) -> int:
    """The split-K of a grid of `tiles` output tiles: the smallest power of two, up to `most`,
    whose slices give every SM of `device` a program (`sm_count`)."""
    sms = sm_count(device)
    split = 1
    while tiles * split < sms and split * 2 <= most:
        split *= 2
    return split
