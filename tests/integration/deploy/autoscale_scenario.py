"""The planner + Ray autoscaler end to end, on `ray.cluster_utils.AutoscalingCluster`.

Run only in a PID + network + mount namespace of its own (test_autoscaling.py does:
`unshare -p -f --mount-proc -n` with private /tmp and /dev/shm): the fake cluster's start and
shutdown run `ray stop --force`, which kills every Ray process it can see, and its head must
listen on the fixed port 6379; inside the namespaces it sees and binds only its own.

Story (prints `SCENARIO OK {json}` at the end, exits non-zero with the reason otherwise):

1. a fake autoscaling cluster: a head with room for one prefill and one decode worker
   (custom resources `prefill`, `decode`), and a `prefill-node` type (0..1) the autoscaler adds;
2. `pdserve up --detach --address 127.0.0.1:6379 --config FILE` with the planner on;
3. a load surge (TTFT over its SLO): the planner starts a second prefill worker, which waits for
   a node; it asks `request_resources` for it, the fake autoscaler adds a prefill node, the
   worker starts there and serves requests;
4. the load stops: the planner drains and stops the extra worker, releases the request, and the
   autoscaler removes the idle node;
5. `pdserve down` kills the detached controller and everything it owns;
6. a leftover detached controller makes `up --address` refuse, and `down --address` removes it.
"""

from __future__ import annotations

import collections
import copy
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.update(
    {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "UCX_TLS": "shm,tcp",
        "UCX_NET_DEVICES": "lo",
        "TOKENIZERS_PARALLELISM": "false",
    }
)

import grpc
import ray
import yaml
from ray.cluster_utils import AutoscalingCluster

ADDRESS = "127.0.0.1:6379"  # the fake provider's worker nodes join the head there
IDLE_TIMEOUT_MIN = 0.05  # 3 s (the planner holds its request_resources until it drained the node)

# The 2.60 wheel lacks fake_multi_node/example.yaml: its content, inlined.
BASE_CONFIG: dict[str, Any] = {
    "cluster_name": "fake_multinode",
    "max_workers": 4,
    "provider": {
        "type": "fake_multinode",
        "use_node_id_as_ip": True,
        "disable_node_updaters": True,
        "disable_launch_config_check": True,
    },
    "available_node_types": {},
    "head_node_type": "ray.head.default",
    "auth": {},
    "upscaling_speed": 1.0,
    "idle_timeout_minutes": IDLE_TIMEOUT_MIN,
    "docker": {},
    "initialization_commands": [],
    "setup_commands": [],
    "head_setup_commands": [],
    "worker_setup_commands": [],
    "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
    "file_mounts": {},
    "cluster_synced_files": [],
    "file_mounts_sync_continuously": False,
    "rsync_exclude": [],
    "rsync_filter": [],
}


class LocalAutoscalingCluster(AutoscalingCluster):
    """AutoscalingCluster with the base config inlined and a lean head (no dashboard, a small
    object store, the fixed port)."""

    def _generate_config(
        self,
        head_resources: dict[str, Any],
        worker_node_types: dict[str, Any],
        autoscaler_v2: bool = False,
        **config_kwargs: Any,
    ) -> dict[str, Any]:
        config = copy.deepcopy(BASE_CONFIG)
        config["available_node_types"] = copy.deepcopy(worker_node_types)
        config["available_node_types"]["ray.head.default"] = {
            "resources": head_resources,
            "node_config": {},
            "max_workers": 0,
        }
        config.update(config_kwargs)
        return config

    def start(self, _system_config: Any = None, override_env: Any = None) -> None:
        fd, path = tempfile.mkstemp(suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(self._config, f)
        resources = dict(self._head_resources)
        cmd = [
            "ray", "start", "--head", f"--autoscaling-config={path}", "--port=6379",
            f"--num-cpus={resources.pop('CPU', 1)}",
            f"--object-store-memory={resources.pop('object_store_memory', 150 << 20)}",
            "--include-dashboard=false", "--disable-usage-stats",
            f"--resources={json.dumps(resources)}",
        ]  # fmt: skip
        env = {**os.environ, "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1"}
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)


class Scenario:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.env = {**os.environ, "PDSERVE_STATE_FILE": str(folder / "run" / "cluster.json")}
        self.times: dict[str, float] = {}
        self.t0 = time.monotonic()

    def mark(self, name: str) -> None:
        self.times[name] = round(time.monotonic() - self.t0, 1)
        print(f"[{self.times[name]:6.1f}s] {name}", flush=True)

    def pdserve(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "deploy.cli.app", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if check and done.returncode != 0:
            output = done.stdout + done.stderr
            raise AssertionError(f"pdserve {args} -> {done.returncode}:\n{output}")
        return done

    def state(self) -> dict[str, Any]:
        return dict(json.loads((self.folder / "run" / "cluster.json").read_text()))

    def status(self) -> Any:
        from deploy.cli import cluster_client as client

        state = self.state()
        return client.status((state.get("admin_targets") or state["targets"])[0])

    def prefill_workers(self) -> dict[str, Any]:
        return {w.worker_id: w for w in self.status().workers if w.role == "prefill"}

    def control_log(self) -> str:
        return Path(self.state()["control_log"]).read_text()


def wait(
    predicate: Callable[[], Any],
    timeout_s: float,
    what: str,
    context: Callable[[], str] = lambda: "",
) -> Any:
    """Poll `predicate` until it holds; on timeout fail with `context()` (what was seen)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{context()}")


def alive_nodes() -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n["Alive"]]


class Surge:
    """Threads sending long prompts back to back (prefill-heavy) until stopped."""

    def __init__(self, target: str, threads: int = 6) -> None:
        from pdserve.v1 import serving_pb2 as pb
        from pdserve.v1 import serving_pb2_grpc as pb_grpc

        self.pb = pb
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.prefill_workers: list[str] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def _run(self, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            prompt = [10 + (n * 7919 + i * 104729 + k * 131) % 480 for k in range(320)]
            req = self.pb.GenerateRequest(
                token_ids=prompt, max_tokens=3, temperature=0.0, ignore_eos=True
            )
            try:
                last = None
                for msg in self.stub.Generate(req, timeout=120):
                    last = msg
                assert last is not None
                self.prefill_workers.append(last.timings.prefill_worker)
            except grpc.RpcError as e:
                self.failures.append(f"{e.code().name}: {e.details()}")

    def start(self) -> Surge:
        for t in self._threads:
            t.start()
        return self

    def describe(self) -> str:
        """What the surge got so far (for a failure message)."""
        failed = collections.Counter(f.split(":", 1)[0] for f in self.failures)
        sample = self.failures[-1] if self.failures else ""
        return f"surge: {len(self.prefill_workers)} served, failed {dict(failed)} {sample}"

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)
        self.channel.close()


def run(folder: Path, model_dir: str) -> dict[str, Any]:
    from pdserve.v1 import serving_pb2 as pb

    s = Scenario(folder)
    cluster = LocalAutoscalingCluster(
        head_resources={"CPU": 2, "prefill": 1, "decode": 1},
        worker_node_types={
            "prefill-node": {
                "resources": {"CPU": 1, "prefill": 1, "object_store_memory": 100 << 20},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 1,
            },
        },
        idle_timeout_minutes=IDLE_TIMEOUT_MIN,
    )
    cluster.start()
    ray.init(address=ADDRESS, namespace="pdserve", log_to_driver=False)
    head_node = ray.get_runtime_context().get_node_id()
    s.mark("autoscaling cluster up")

    config = {
        "model": model_dir,
        "prefill": 1,
        "decode": 1,
        "grpc_port": 50051,
        "metrics_port": 0,
        "engine": {
            "device": "cpu",
            "dtype": "float32",
            "num_kv_blocks": 160,
            "max_model_len": 512,
            "attention_backend": "torch",
            "cuda_graphs": False,
        },
        "thresholds": {"local_prefill_threshold_tokens": 0},
        "placement": {
            "prefill": {"num_cpus": 0, "resources": {"prefill": 1}},
            "decode": {"num_cpus": 0, "resources": {"decode": 1}},
        },
        "planner": {
            "enabled": True,
            "interval_s": 1.0,
            "sample_window_s": 4.0,
            # Below what the surge's TTFT is on a quiet machine (p90 ~110 ms with one prefill
            # worker): at 150 ms a fast run never scaled up (it passed only under load).
            "ttft_slo_ms": 50.0,
            "tpot_slo_ms": 5000.0,
            "cold_start_s": 2.0,
            "min_samples": 3,
            "cooldown_ticks": 2,
            "max_queue_per_prefill_worker": 2.0,
            "prefill": {"min_workers": 1, "max_workers": 2},
            "decode": {"min_workers": 1, "max_workers": 1},
        },
    }
    cfg = folder / "pdserve.yaml"
    cfg.write_text(yaml.safe_dump(config))
    s.pdserve("up", "--detach", "--address", ADDRESS, "--config", str(cfg), "--timeout", "500")
    state = s.state()
    assert state["ray_external"] is True, state
    (first,) = s.prefill_workers()
    s.mark("pdserve up --address")

    # 3. surge -> +1 prefill, pending until the autoscaler adds a prefill node.
    surge = Surge(state["targets"][0]).start()
    added = wait(
        lambda: (
            [w for w in s.prefill_workers() if w != first]
            or [line for line in s.control_log().splitlines() if "starting prefill" in line]
        ),
        120,
        "the planner to start a prefill worker",
        lambda: (
            f"{surge.describe()}\ncontrol log:\n{s.control_log()[-3000:]}\n"
            f"status:\n{str(s.status())[-3000:]}"
        ),
    )
    s.mark(f"planner scaled prefill up: {added}")
    wait(lambda: len(alive_nodes()) == 2, 120, "the autoscaler to add a node")
    new_node = next(n["NodeID"] for n in alive_nodes() if n["NodeID"] != head_node)
    assert ray.cluster_resources().get("prefill") == 2.0, ray.cluster_resources()
    s.mark("autoscaler added a prefill node")

    def second_ready() -> Any:
        ready = [
            w
            for w in s.prefill_workers().values()
            if w.worker_id != first and w.state == pb.WORKER_STATE_READY
        ]
        return ready[0] if ready else None

    second = wait(second_ready, 180, "the new prefill worker to be ready")
    assert second.node == new_node, (second.node, new_node)
    s.mark(f"{second.worker_id} ready on the new node")
    wait(
        lambda: second.worker_id in surge.prefill_workers,
        60,
        f"{second.worker_id} to serve a request",
    )
    s.mark(f"{second.worker_id} served requests")
    surge.stop()
    served_by_second = surge.prefill_workers.count(second.worker_id)

    # 4. idle -> drain + stop the extra worker, release the request, node removed.
    wait(lambda: list(s.prefill_workers()) == [first], 120, "the planner to scale prefill down")
    s.mark("planner scaled prefill down")
    wait(lambda: len(alive_nodes()) == 1, 120, "the autoscaler to remove the idle node")
    s.mark("autoscaler removed the idle node")
    log = s.control_log()
    for needle in (
        "planner: starting prefill worker(s)",
        f"planner: draining prefill worker(s) ['{second.worker_id}']",
        f"worker {second.worker_id} stopped",
        "planner: request_resources [{'prefill': 1.0}, {'decode': 1.0}, {'prefill': 1.0}]",
        "slack: TTFT p90",
    ):
        assert needle in log, f"{needle!r} not in the control log:\n{log}"
    # The surge is seen as TTFT over the SLO or as the prefill queue over its bound.
    assert "> SLO 50 ms" in log or "per worker" in log, log
    requests = [line for line in log.splitlines() if "planner: request_resources" in line]
    assert requests[-1].endswith("[{'prefill': 1.0}, {'decode': 1.0}]"), requests
    planner_lines = [line for line in log.splitlines() if " planner tick " in line]
    status = json.loads(s.pdserve("status", "--json", "--events", "20").stdout)
    assert " planner tick " in status["planner"], status["planner"]
    assert any(f"worker {second.worker_id} stopped" in e for e in status["events"]), status
    assert {w["node"] for w in status["workers"]} == {head_node}  # back to the head only

    # 5. down kills the detached controller (and the workers it owns).
    s.pdserve("down", "--timeout", "120")
    from deploy.control.cluster_controller import CONTROLLER_NAME

    def pdserve_actors() -> list[str]:
        return [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "pdserve"
        ]

    wait(lambda: not pdserve_actors(), 30, "no pdserve actor left after down")
    s.mark("pdserve down: controller and workers gone")

    # 6. a leftover detached controller: up refuses, down --address removes it.
    class Leftover:
        def shutdown(self) -> None:
            pass

    leftover_cls: Any = ray.remote(num_cpus=0)(Leftover)
    leftover = leftover_cls.options(
        name=CONTROLLER_NAME, namespace="pdserve", lifetime="detached"
    ).remote()
    ray.get(leftover.shutdown.remote())
    refused = s.pdserve("up", "--address", ADDRESS, "--config", str(cfg), check=False)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "already runs on this Ray cluster" in refused.stdout + refused.stderr
    removed = s.pdserve("down", "--address", ADDRESS)
    assert CONTROLLER_NAME in removed.stdout, removed.stdout
    wait(lambda: not pdserve_actors(), 30, "the leftover controller removed")
    s.mark("leftover controller: up refused, down --address removed it")
    # Overload may be shed by admission (RESOURCE_EXHAUSTED, by design); nothing else fails.
    assert all(f.startswith("RESOURCE_EXHAUSTED") for f in surge.failures), surge.failures[:5]
    return {
        "times": s.times,
        "scaled_up_worker": second.worker_id,
        "requests_served_by_new_worker": served_by_second,
        "surge_requests": len(surge.prefill_workers),
        "surge_shed": len(surge.failures),
        "planner_ticks_logged": len(planner_lines),
    }


def main() -> int:
    model_dir = sys.argv[1]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result = run(Path(tmp), model_dir)
    except BaseException:
        # Exit at once: a normal exit waits for the Ray driver's shutdown while the fake
        # cluster and the detached `up` still run, which hung the scenario until the test's
        # timeout. The namespace's end takes every process with it.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    print("SCENARIO OK " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
