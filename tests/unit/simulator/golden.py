"""The scenarios whose every request's outcome is recorded in data/golden.json (the simulator's
predictions, held request by request by tests/unit/simulator/test_golden.py so that a change
meant only to speed it up cannot move them). Re-record only with a change meant to move them
(a fidelity fix), and say in its commit what moved and why.

    python tests/unit/simulator/golden.py   # rewrites data/golden.json (run from the repo root)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/: sim_profiles

from sim_profiles import tiny_cpu_profile  # noqa: E402

from admission.config import AdmissionThresholds  # noqa: E402
from loadtests.workload import generate, load_profile  # noqa: E402
from router.prefill_cost import LocalPrefillPolicy  # noqa: E402
from simulator.cluster import Simulation  # noqa: E402
from simulator.shape import ClusterShape  # noqa: E402
from simulator.workers import SimRequest  # noqa: E402

GOLDEN = HERE / "data" / "golden.json"

# (name, workload, rate, duration s, shape): queueing (a low in-flight limit), local prefill by
# threshold and by cost, prefix reuse (shared prefixes, multi-turn), colocated workers.
SCENARIOS: dict[str, tuple[str, float, float, ClusterShape]] = {
    "synthetic-2p3d-queue": ("synthetic", 40.0, 6.0, ClusterShape(
        2, 3, kv_blocks=512, thresholds=AdmissionThresholds(max_inflight_requests=24))),
    "shared-prefix-2p2d-cost": ("shared_prefix", 30.0, 6.0, ClusterShape(
        2, 2, kv_blocks=512, local_prefill=LocalPrefillPolicy.COST)),
    "multi-turn-1p2d-1c": ("multi_turn", 12.0, 8.0, ClusterShape(1, 2, 1, kv_blocks=256)),
    "mixed-3c": ("mixed", 20.0, 6.0, ClusterShape(0, 0, 3, kv_blocks=256)),
}  # fmt: skip


def outcome(r: SimRequest) -> dict[str, Any]:
    return {
        "index": r.planned.index,
        "status": r.status,
        "sent_s": r.sent_s,
        "done_s": r.done_s,
        "cached_tokens": r.cached_tokens,
        "decode_worker": r.decode_worker,
        "placement": None if r.placement is None else r.placement.value,
        "handoff_s": r.handoff_s,
        "tokens": r.tokens,
        "first_token_s": r.first_token_s if r.tokens else None,
        "last_token_s": r.last_token_s if r.tokens else None,
        "token_times_sum": sum(r.token_times or ()),
    }


def run(name: str) -> list[dict[str, Any]]:
    workload, rate, duration, shape = SCENARIOS[name]
    planned = generate(load_profile(workload), rate=rate, duration_s=duration, seed=0)
    sim = Simulation(tiny_cpu_profile(), shape, trace_tokens=True)
    return [outcome(r) for r in sim.run(planned)]


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps({name: run(name) for name in SCENARIOS}) + "\n")
    print(f"wrote {GOLDEN}")
