"""The SMs of one GPU shared between a split engine's two loops (engine/core/prefill_lane.py).

Each loop launches its work on a stream of its own; on a GPU whose driver has CUDA green
contexts the two streams belong to two partitions of the device's SMs, so a long prefill and
the decode steps run at once without competing for SMs. Stream priorities alone do not
isolate: a prefill's thousands of blocks still occupy every SM a decode step needs.

`SMSplit` makes one partition pair per decode share it is asked for and keeps them (a
share is a green context and a stream on each side; CUDA graphs are captured per stream,
engine/core/cuda_graphs.py). Each pair is one split of the device's SMs, so its two sides
never share an SM (`partition_pair`). The driver rounds the count asked to its SM groups
(Hopper: up to a multiple of 8, 66 asked gives 72): `status()` reports what was granted.
Without green contexts (CPU, an older driver, no flashinfer) both loops run on plain streams
of the whole device, and status says so.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vocabulary.engine_io import SplitStatus
from vocabulary.split_policy import decode_shares

log = logging.getLogger(__name__)

HISTORY = 4096
"""How many splits `SMSplit.history` keeps (a split changes at most once a second)."""


@dataclass
class Partition:
    """A stream whose kernels run on `sms` SMs (all of them when not partitioned)."""

    stream: torch.cuda.Stream | None
    sms: int
    keep: object = None
    """What must outlive the stream (its green context)."""


def green_context_stream(device: torch.device, num_sms: int) -> Partition:
    """A stream of a green context of about `num_sms` SMs on `device`, with the count the
    driver granted where it can be read (RuntimeError naming why none can be made here).

    One partition alone (a benchmark's "this many SMs" figure). Two made this way are not
    disjoint: each is cut from the whole device and the driver hands both the same first SM
    groups; a split engine takes its pair from `partition_pair`.

    flashinfer's helper (CUDA's Python bindings) reads the granted count back; torch's own
    green contexts (beta) do not say it, so the count asked is reported there."""
    errors = []
    try:
        from flashinfer.green_ctx import split_device_green_ctx_by_sm_count

        streams, resources = split_device_green_ctx_by_sm_count(device, [num_sms])
        return Partition(streams[0], int(resources[0].sm.smCount), keep=(streams, resources))
    except Exception as e:  # an optional extra and a beta driver API: any failure is "not here"
        errors.append(f"flashinfer.green_ctx: {e}")
    try:
        from torch.cuda.green_contexts import GreenContext

        try:
            ctx = GreenContext.create(num_sms=num_sms, device_id=device.index or 0)
        except TypeError:  # torch < 2.12 takes them by position
            ctx = GreenContext.create(num_sms, device.index or 0)  # type: ignore[call-arg,arg-type]
        return Partition(ctx.Stream(), num_sms, keep=ctx)  # type: ignore[attr-defined]
    except Exception as e:  # RuntimeError, AttributeError (no Stream before 2.12), ...
        errors.append(f"torch green contexts: {e}")
    raise RuntimeError("; ".join(errors))


def partition_pair(
    device: torch.device, decode_sms: int, total_sms: int
) -> tuple[Partition, Partition]:
    """(prefill, decode) streams on disjoint SMs: decode on about `decode_sms` (the driver
    rounds up to its SM groups), prefill on every SM left. Both come from one split of the
    device's SMs, the only way to make them disjoint (flashinfer's helper splits the device's
    SM resource into the group asked and the remainder). torch's green contexts cut each
    context from the whole device, so a pair of them would share SMs: no fallback there.
    RuntimeError naming why a pair cannot be made (or, never expected, overlaps)."""
    try:
        from flashinfer.green_ctx import split_device_green_ctx_by_sm_count

        streams, resources = split_device_green_ctx_by_sm_count(device, [decode_sms])
    except Exception as e:  # an optional extra and a beta driver API: any failure is "not here"
        raise RuntimeError(
            f"flashinfer.green_ctx: {e} (torch's own green contexts cannot make a disjoint pair)"
        ) from e
    keep = (streams, resources)
    decode = Partition(streams[0], int(resources[0].sm.smCount), keep=keep)
    prefill = Partition(streams[1], int(resources[1].sm.smCount), keep=keep)
    if decode.sms + prefill.sms > total_sms or min(decode.sms, prefill.sms) < 1:
        raise RuntimeError(
            f"SM partitions of {decode.sms} + {prefill.sms} SMs do not split the device's "
            f"{total_sms}"
        )
    return prefill, decode


class SMSplit:
    """The prefill and decode streams of a split engine, and the share of SMs each has."""

    def __init__(self, device: torch.device, decode_sms: int = 0) -> None:
        """`decode_sms`: SMs of the decode partition (0: adaptive, starting at the largest
        share of at most half the device)."""
        self.device = device
        self.resizes = 0
        self.reason = ""
        self.total_sms = 0
        self.shares: tuple[int, ...] = ()
        """The decode shares partitions are made for (the whole device is one more)."""
        self._pairs: dict[int, tuple[Partition, Partition]] = {}
        self.history: deque[tuple[float, int, int]] = deque(maxlen=HISTORY)
        """(time.monotonic(), decode SMs, prefill SMs) at the start and at every resize."""
        if device.type != "cuda":
            self.reason = "no CUDA device: both loops run on the CPU, one after the other"
            self._current = (Partition(None, 0), Partition(None, 0))
            self._record()
            return
        total = self.total_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.shares = (decode_sms,) if decode_sms else decode_shares(total)
        whole = (Partition(torch.cuda.Stream(device), total),
                 Partition(torch.cuda.Stream(device), total))  # fmt: skip
        self._pairs[total] = whole
        self._current = whole
        start = decode_sms or max((s for s in self.shares if s <= total // 2), default=total // 2)
        try:
            self._current = self._pair(start)
        except RuntimeError as e:
            self.reason = f"no SM partitions: {e}; both loops share every SM"
            log.warning("split engine: %s", self.reason)
        self._record()

    def _record(self) -> None:
        self.history.append((time.monotonic(), self._current[1].sms, self._current[0].sms))

    @property
    def partitioned(self) -> bool:
        return not self.reason

    def _pair(self, decode_sms: int) -> tuple[Partition, Partition]:
        """(prefill, decode) partitions with `decode_sms` SMs for decode; the whole device
        for both at the device's SM count."""
        decode_sms = max(1, min(decode_sms, self.total_sms))
        if decode_sms not in self._pairs:
            self._pairs[decode_sms] = partition_pair(self.device, decode_sms, self.total_sms)
        return self._pairs[decode_sms]

    def resize(self, decode_sms: int) -> bool:
        """Give the decode loop `decode_sms` SMs (the device's count: every SM, shared) from
        its next step on, the prefill loop the rest; False when nothing changed."""
        if not self.partitioned:
            return False
        pair = self._pair(decode_sms)
        if pair is self._current:
            return False
        for old, new in zip(self._current, pair, strict=True):
            # a loop's next step may read what its last one (on the old stream) writes
            if old.stream is not None and new.stream is not None:
                new.stream.wait_stream(old.stream)
        self._current = pair
        self.resizes += 1
        self._record()
        return True

    @property
    def decode_share(self) -> int:
        """The decode share in use (a key of `shares`, or the device's SM count)."""
        return next(k for k, pair in self._pairs.items() if pair is self._current)

    def all_shares(self) -> tuple[int, ...]:
        """Every decode share this split may move to (the device's SM count: all of them),
        the one in use first; empty when not partitioned."""
        if not self.partitioned:
            return ()
        rest = [s for s in (*self.shares, self.total_sms) if s != self.decode_share]
        return (self.decode_share, *rest)

    @contextlib.contextmanager
    def decode_on(self, decode_sms: int) -> Iterator[None]:
        """Work queued inside runs where the decode loop would with `decode_sms` SMs (to
        capture its CUDA graphs there), whatever share is in use."""
        with _on(self._pair(decode_sms)[1].stream):
            yield

    def decode_bytes_per_s(self) -> tuple[tuple[int, float], ...]:
        """(SMs granted, copy bytes/s) of the decode side of every share: the measured
        curve the adaptive split predicts step times from."""
        points = {}
        for share in self.all_shares():
            part = self._pair(share)[1]
            with _on(part.stream):
                points[part.sms] = hbm_bytes_per_s(self.device, 128 << 20)
        torch.cuda.empty_cache()  # (blocks cached for a stream serve only that stream)
        return tuple(sorted(points.items()))

    @property
    def decode_stream(self) -> torch.cuda.Stream | None:
        return self._current[1].stream

    @contextlib.contextmanager
    def prefill(self) -> Iterator[None]:
        """Work queued inside runs on the prefill partition."""
        with _on(self._current[0].stream):
            yield

    @contextlib.contextmanager
    def decode(self) -> Iterator[None]:
        """Work queued inside runs on the decode partition."""
        with _on(self._current[1].stream):
            yield

    def status(
        self, handoffs: int = 0, handoff_us: tuple[float, float] = (0.0, 0.0)
    ) -> SplitStatus:
        prefill, decode = self._current
        return SplitStatus(
            partitioned=self.partitioned,
            reason=self.reason,
            total_sms=self.total_sms,
            decode_sms=decode.sms,
            prefill_sms=prefill.sms,
            resizes=self.resizes,
            handoffs=handoffs,
            handoff_us_mean=handoff_us[0],
            handoff_us_max=handoff_us[1],
        )


def hbm_bytes_per_s(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Device memory bandwidth (read + write) of a plain copy on the whole device."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()  # (on the current stream: a partition's, inside `_on`)
    for _ in range(4):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 4 * 2 * nbytes / (start.elapsed_time(end) / 1e3)


@contextlib.contextmanager
def _on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield
