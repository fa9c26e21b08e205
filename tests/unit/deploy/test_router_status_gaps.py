"""What `pdserve status` shows for a worker the router has registered but not polled yet:
STARTING (router/servicer.py `AdminServicer.Status`), not DEAD, so a healthy new worker does
not read "dead" for a poll interval after a rebalance or replacement.
"""

from __future__ import annotations

import asyncio

from admission.controller import AdmissionController
from pdserve.v1 import serving_pb2 as pb
from router.cluster_view import ClusterView, StaticDirectory
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.servicer import AdminServicer
from vocabulary.worker_api import WorkerInfo, WorkerRole


def status_of_registered_unpolled_worker() -> int:
    info = WorkerInfo("decode-7", WorkerRole.DECODE, "pdserve-worker-decode-7", "node", "cpu",
                      "tiny", 16, 512, 512, 64)  # fmt: skip

    async def run() -> int:
        metrics = RouterMetrics()
        view = ClusterView(StaticDirectory([(info, object())]), metrics)
        await view.refresh_registry()  # registered; its load is not polled yet
        admission = AdmissionController()
        servicer = AdminServicer(
            view, admission, Orchestrator(view, admission, None, "tiny"), metrics, None, "tiny"
        )
        status = await servicer.Status(pb.StatusRequest(), None)
        (worker,) = status.workers
        return int(worker.state)

    return asyncio.run(run())


def test_registered_worker_without_a_load_report_is_starting_not_dead() -> None:
    assert status_of_registered_unpolled_worker() == pb.WORKER_STATE_STARTING
