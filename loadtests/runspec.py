"""What one load run sends and where its records go; passed to the Locust process by env var."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtests.workload import PlannedRequest, generate, load_profile

ENV_VAR = "PDSERVE_BENCH_SPEC"


@dataclass(frozen=True)
class RunSpec:
    profile: str
    """Shipped profile name or a YAML path."""
    rate: float
    """Offered requests/s."""
    duration_s: float
    """Arrival window; the run lasts until the last request completes (or times out)."""
    seed: int = 0
    num_requests: int | None = None
    """Cut the workload to its first N requests (None: everything in the window)."""
    records_path: str | None = None
    """JSONL file that per-request records are appended to (None: not written)."""
    request_timeout_s: float = 300.0
    """gRPC deadline of each call."""
    itl_events: bool = True
    """Locust only: fire one ITL event per inter-message gap (off for very high rates)."""

    def plan(self) -> list[PlannedRequest]:
        return generate(
            load_profile(self.profile),
            rate=self.rate,
            duration_s=self.duration_s,
            seed=self.seed,
            num_requests=self.num_requests,
        )

    @property
    def records(self) -> Path | None:
        return Path(self.records_path) if self.records_path else None

    def to_env(self) -> dict[str, str]:
        return {ENV_VAR: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> RunSpec:
        raw = environ.get(ENV_VAR)
        if not raw:
            raise RuntimeError(f"{ENV_VAR} is not set: run this through loadtests.bench")
        return cls(**json.loads(raw))
