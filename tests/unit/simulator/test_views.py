"""The simulated router hands `place` and `evaluate` only the workers that can win
(simulator/views.py); over random worker states their answers are the ones every worker gives."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from sim_profiles import tiny_cpu_profile

from admission.config import AdmissionThresholds
from admission.policy import evaluate
from admission.snapshot import (
    AdmissionRequest,
    ClusterSnapshot,
    DecodeWorkerLoad,
    PrefillWorkerLoad,
)
from router.placement import DecodeCandidate, PlacementConfig, PrefillCandidate, place
from router.prefill_cost import LocalPrefillPolicy
from simulator.views import WorkerViews

BLOCK = 16
CONFIGS = (
    PlacementConfig(4.0, 64),
    PlacementConfig(4.0, 0),
    PlacementConfig(
        4.0, 64, local_prefill_policy=LocalPrefillPolicy.COST,
        prefill_cost=tiny_cpu_profile().prefill_cost_model(),
    ),
)  # fmt: skip


def make_views(rng: random.Random) -> WorkerViews:
    queues = [rng.choice([0, 0, 16, 40, 300]) for _ in range(rng.randint(0, 5))]
    pre = tuple(PrefillCandidate(f"p{i}", 0, queued) for i, queued in enumerate(queues))
    dec = []
    for i in range(rng.randint(1, 6)):
        active, inflight = rng.choice([0, 3, 3, 10, 40]), rng.choice([0, 0, 2, 5])
        dec.append(DecodeCandidate(
            f"{rng.choice('dc')}{i}", 0, active, inflight, 48 - active,
            prefills_locally=rng.random() < 0.3, running_requests=rng.randint(0, 4),
            queued_prefill_tokens=rng.choice([0, 0, 50]),
        ))  # fmt: skip
    loads = tuple(PrefillWorkerLoad(c.worker_id, c.queued_prefill_tokens, 3000.0) for c in pre)
    return WorkerViews(
        loads,
        tuple(DecodeWorkerLoad(d.worker_id, 48, d.free_kv_blocks) for d in dec),
        pre,
        tuple(dec),
        sorted((c.queued_prefill_tokens, c.worker_id, i) for i, c in enumerate(pre)),
        sorted(
            (d.active_kv_blocks + d.inflight_transfer_blocks, d.worker_id, i)
            for i, d in enumerate(dec)
        ),
        {c.worker_id: i for i, c in enumerate(pre)},
        {d.worker_id: i for i, d in enumerate(dec)},
    )


@pytest.mark.parametrize("seed", range(4))
def test_the_kept_candidates_place_and_admit_as_every_worker_does(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        views = make_views(rng)
        ids = [c.worker_id for c in (*views.prefill_candidates, *views.decode_candidates)]
        cached_by = {w: rng.randint(1, 12) for w in ids if rng.random() < 0.3}
        frees = [d.free_kv_blocks for d in views.decode_candidates]
        prompt, need = rng.randint(1, 200), rng.choice([rng.randint(0, 30), *frees])
        every_prefill = [replace(c, cached_blocks=cached_by.get(c.worker_id, 0))
                         for c in views.prefill_candidates]  # fmt: skip
        every_decode = [replace(d, cached_blocks=cached_by.get(d.worker_id, 0))
                        for d in views.decode_candidates]  # fmt: skip
        kept = views.candidates(cached_by, need)
        for config in CONFIGS:
            assert place(prompt, BLOCK, *kept, config, need) == place(
                prompt, BLOCK, every_prefill, every_decode, config, need
            )
        request = AdmissionRequest("r", prompt, rng.randint(0, prompt), rng.randint(1, 300))

        thresholds = AdmissionThresholds(max_estimated_ttft_ms=rng.choice([20.0, 2000.0]))
        decisions = [
            evaluate(
                request, ClusterSnapshot(prefill, views.decode_loads, 64, 0, BLOCK), thresholds
            )
            for prefill in (views.admission_prefill(), views.prefill_loads)
        ]
        assert decisions[0] == decisions[1]
