"""`pdserve chaos`: a local cluster from the config tree, a chaos run against it
(loadtests/chaos_run.py), its report printed and written as JSON.

`ClusterChaos` is the chaos run's `ChaosTarget` over a running `Cluster`: it kills worker
actors through Ray (the controller notices and replaces them), restarts the embedded Redis on
its port, and reads every worker's load and every router's in-flight count for the idle check.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from deploy.control.config_tree import PdserveConfig
from deploy.control.launch import Cluster
from loadtests.chaos_run import ChaosConfig, ChaosReport, ChaosRun
from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc

CALL_TIMEOUT_S = 10.0


class ClusterChaos:
    def __init__(self, cluster: Cluster) -> None:
        assert cluster.endpoint is not None, "start the cluster first"
        self.cluster = cluster
        self.endpoint = cluster.endpoint
        self.key_prefix = cluster.config.cluster.name
        # Admin (Status) is on each router's admin plane, not its data port
        self._channels = [grpc.insecure_channel(t) for t in self.endpoint.admin]

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def _workers(self) -> dict[str, tuple[str, Any]]:
        """Ready workers: id -> (role, actor handle)."""
        import ray

        controller = self.cluster.controller
        states = ray.get(controller.describe.remote(), timeout=CALL_TIMEOUT_S)
        ready = {d["worker_id"] for d in states if d["state"].value == "ready"}
        listed = ray.get(controller.list_workers.remote(), timeout=CALL_TIMEOUT_S)
        return {
            info.worker_id: (info.role.value, handle)
            for info, handle in listed
            if info.worker_id in ready
        }

    def worker_ids(self, role: str) -> list[str]:
        return sorted(w for w, (r, _) in self._workers().items() if r == role)

    def kill_worker(self, worker_id: str) -> None:
        import ray

        _, handle = self._workers()[worker_id]
        ray.kill(handle, no_restart=True)

    def restart_redis(self) -> None:
        redis = self.cluster.redis
        if redis is None:
            raise RuntimeError("the cluster runs on an external Redis: chaos restarts only its own")
        redis.stop()
        redis.start()

    def busy_workers(self) -> dict[str, str]:
        import ray

        busy: dict[str, str] = {}
        workers = self._workers()
        loads = ray.get([h.load.remote() for _, h in workers.values()], timeout=30)
        for load in loads:
            held = load.held()
            if held:
                busy[load.worker_id] = held
        for i, ch in enumerate(self._channels):
            status = pb_grpc.AdminStub(ch).Status(pb.StatusRequest(), timeout=CALL_TIMEOUT_S)
            if status.router_inflight_requests:
                busy[f"router-{i}"] = f"{status.router_inflight_requests} requests in flight"
        return busy

    def migrations(self) -> float:
        total = 0.0
        for url in self.endpoint.metrics:
            with urllib.request.urlopen(url, timeout=CALL_TIMEOUT_S) as r:
                text = r.read().decode()
            for family in text_string_to_metric_families(text):
                if family.name == "pdserve_migrations":
                    total += sum(s.value for s in family.samples if s.name.endswith("_total"))
        return total

    def unindexed_workers(self) -> list[str]:
        import redis

        client = redis.Redis.from_url(self.endpoint.redis_url, socket_timeout=CALL_TIMEOUT_S)
        try:
            indexed = {
                key.decode().rsplit("seq:", 1)[1]
                for key in client.scan_iter(match=f"{self.key_prefix}:*seq:*")
            }
        finally:
            client.close()
        return sorted(set(self._workers()) - indexed)


def run_chaos(
    config: PdserveConfig, chaos: ChaosConfig, out: Path, console: Console
) -> ChaosReport:
    """Start a cluster, run `chaos` against it, stop it; the report is also in `out`."""
    cluster = Cluster(config)
    console.print("starting a cluster for the chaos run ...")
    endpoint = cluster.start()
    target = ClusterChaos(cluster)
    try:
        console.print(
            f"chaos: {chaos.duration_s:g}s at {chaos.load_multiple:g}x capacity, a kill every "
            f"{chaos.kill_every_s:g}s, Redis restarted every {chaos.redis_restart_every_s:g}s"
        )
        report = ChaosRun(endpoint.target, target, chaos).run()
    finally:
        target.close()
        cluster.stop()
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.json").write_text(json.dumps(report.as_dict(), indent=2))
    console.print(report_table(report))
    return report


def report_table(report: ChaosReport) -> Table:
    table = Table(title="chaos run", show_header=False)
    rows: list[tuple[str, str]] = [
        ("capacity / offered", f"{report.capacity_rps:.2f} / {report.rate_rps:.2f} req/s"),
        ("sent / completed", f"{report.sent} / {report.completed}"),
        ("statuses", ", ".join(f"{k} {v}" for k, v in sorted(report.statuses.items()))),
        ("unexpected statuses", str(report.unexpected or 0)),
        ("token mismatches", str(report.token_mismatches)),
        ("hung", str(report.hung)),
        ("migrations", f"{report.migrations:g}"),
        ("redis restarts", str(report.redis_restarts)),
        ("TPOT p50", f"{report.tpot_p50_ms:.1f} ms"),
        ("gap at a decode kill p50 / p99",
         f"{report.migration_gap_p50_ms} / {report.migration_gap_p99_ms} ms"),
        ("leaked", str(report.leaked or 0)),
        ("not in the index at the end", ", ".join(report.unindexed) or "none"),
    ]  # fmt: skip
    for k in report.kills:
        recovered = "never" if k.recovered_s is None else f"{k.recovered_s:.1f}s"
        rows.append((f"kill {k.role} {k.worker_id} at {k.at_s:.1f}s", f"replaced in {recovered}"))
    for status, messages in sorted(report.status_samples.items()):
        rows.append((f"{status}, e.g.", " | ".join(m[:120] for m in messages)))
    rows.append(("clean", "yes" if report.clean else "NO"))
    for key, value in rows:
        table.add_row(key, value)
    return table
