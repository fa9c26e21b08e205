"""One record per request, measured the same way by the Locust user and the asyncio driver.

TTFT is send -> first message carrying tokens; TPOT is the mean time per token after the first,
(last token time - first token time) / (output tokens - 1); ITL is the gap between consecutive
messages carrying tokens (a message may carry several tokens); E2E is send -> stream end.
Records are JSON lines so a run can be appended to from several processes and re-read later.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any

OK = "OK"


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    index: int
    sent_s: float
    """Send time, offset from the start of the run."""
    scheduled_s: float
    """When the workload planned to send it (sent_s - scheduled_s is the driver's lag)."""
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    e2e_ms: float
    ttft_ms: float | None = None
    """None when no token arrived."""
    tpot_ms: float | None = None
    """None with fewer than two output tokens."""
    itl_ms: tuple[float, ...] = ()
    status: str = OK
    """gRPC status code name ("OK", "RESOURCE_EXHAUSTED", ...)."""
    error: str = ""
    retry_after_ms: float | None = None
    """From the `retry-after-ms` trailing metadata of a rejection."""
    finish_reason: str = ""
    cached_prompt_tokens: int = 0
    server_queue_ms: float | None = None
    server_ttft_ms: float | None = None
    server_prefill_ms: float | None = None
    server_transfer_ms: float | None = None
    """KV hand-off time reported by the decode worker (0 for local prefill)."""
    offered_rate: float | None = None
    """Requests/s of the run that produced it (keys a sweep)."""
    conversation: int | None = None
    turn: int = 0

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def end_s(self) -> float:
        return self.sent_s + self.e2e_ms / 1000.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> RequestRecord:
        return cls.from_dict(json.loads(line))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        """A record from `asdict`'s form (unknown keys ignored, itl_ms as a tuple)."""
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {k: v for k, v in data.items() if k in known}
        values["itl_ms"] = tuple(values.get("itl_ms", ()))
        return cls(**values)


def write_records(path: Path, records: Iterable[RequestRecord]) -> None:
    with path.open("w") as f:
        for record in records:
            f.write(record.to_json() + "\n")


def read_records(path: Path) -> list[RequestRecord]:
    with path.open() as f:
        return list(iter_records(f))


def iter_records(stream: IO[str]) -> Iterator[RequestRecord]:
    for line in stream:
        if line.strip():
            yield RequestRecord.from_json(line)


class RecordSink:
    """Appends records to a JSONL file as they complete (one line per write, flushed)."""

    def __init__(self, path: Path | None) -> None:
        self._file = path.open("a") if path is not None else None

    def write(self, record: RequestRecord) -> None:
        if self._file is not None:
            self._file.write(record.to_json() + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass
class StreamTimer:
    """Clock readings of one streaming call, turned into a record. Pure: no clock of its own."""

    sent_at: float
    """Clock reading (s) when the call started."""
    message_times: list[float] = field(default_factory=list)
    """Arrival of each message that carried tokens."""
    output_tokens: int = 0

    def on_message(self, now: float, num_tokens: int) -> bool:
        """Note one streamed message; True when it carried the first token."""
        if num_tokens <= 0:
            return False
        first = self.output_tokens == 0
        self.message_times.append(now)
        self.output_tokens += num_tokens
        return first

    @property
    def ttft_ms(self) -> float | None:
        if not self.message_times:
            return None
        return (self.message_times[0] - self.sent_at) * 1000.0

    @property
    def tpot_ms(self) -> float | None:
        if self.output_tokens < 2:
            return None
        span = self.message_times[-1] - self.message_times[0]
        return span * 1000.0 / (self.output_tokens - 1)

    @property
    def itl_ms(self) -> tuple[float, ...]:
        return tuple((b - a) * 1000.0 for a, b in itertools.pairwise(self.message_times))

    def e2e_ms(self, ended_at: float) -> float:
        return (ended_at - self.sent_at) * 1000.0
