"""The split engine's SM partitions: one split of the device, so the two sides are disjoint
(flashinfer's green-context helper replaced by a recorder: the driver part is a GPU test)."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.core.sm_split import SMSplit, partition_pair

CUDA = torch.device("cuda", 0)


def fake_helper(monkeypatch: pytest.MonkeyPatch, granted: list[int]) -> list[Any]:
    """Install a flashinfer.green_ctx whose split grants `granted` (asked groups, then the
    remainder); returns the list its calls are recorded in."""
    calls: list[Any] = []

    def split(device: torch.device, sm_counts: list[int]) -> tuple[list[str], list[Any]]:
        calls.append((device, list(sm_counts)))
        streams = [f"stream-{i}" for i in range(len(granted))]
        return streams, [SimpleNamespace(sm=SimpleNamespace(smCount=n)) for n in granted]

    pkg = types.ModuleType("flashinfer")
    mod = types.ModuleType("flashinfer.green_ctx")
    mod.split_device_green_ctx_by_sm_count = split  # type: ignore[attr-defined]
    pkg.green_ctx = mod  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.green_ctx", mod)
    return calls


def test_the_pair_is_one_split_decode_first_prefill_the_remainder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = fake_helper(monkeypatch, [72, 60])  # H100: 66 asked, rounded up to 72
    prefill, decode = partition_pair(CUDA, 66, 132)
    assert calls == [(CUDA, [66])]  # one split, not two contexts cut from the whole device
    assert (decode.stream, decode.sms) == ("stream-0", 72)
    assert (prefill.stream, prefill.sms) == ("stream-1", 60)
    assert decode.keep is prefill.keep  # the contexts live as long as either stream


@pytest.mark.parametrize("granted", [[72, 72], [132, 0]])
def test_a_pair_that_would_share_or_starve_sms_is_refused(
    monkeypatch: pytest.MonkeyPatch, granted: list[int]
) -> None:
    fake_helper(monkeypatch, granted)
    with pytest.raises(RuntimeError, match=r"do not split the device's 132"):
        partition_pair(CUDA, 66, 132)


def test_without_flashinfer_there_is_no_pair_and_the_reason_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails
    monkeypatch.setitem(sys.modules, "flashinfer.green_ctx", None)
    with pytest.raises(RuntimeError, match="torch's own green contexts cannot make a disjoint"):
        partition_pair(CUDA, 66, 132)


def test_without_a_gpu_the_split_says_why_and_records_its_one_state() -> None:
    split = SMSplit(torch.device("cpu"))
    assert not split.partitioned and "no CUDA device" in split.reason
    assert split.all_shares() == () and not split.resize(32)
    assert [entry[1:] for entry in split.history] == [(0, 0)]
