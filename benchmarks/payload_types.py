"""The trace-context types benchmarks/bench_ray_payload.py compares with the plain tuple
(in a module of their own: the actor's process unpickles them by reference, as it would a
type of pdserve's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class DataclassContext:
    traceparent: str
    tracestate: str = ""


class NamedContext(NamedTuple):
    traceparent: str
    tracestate: str = ""
