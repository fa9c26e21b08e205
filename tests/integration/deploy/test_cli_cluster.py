"""The `pdserve` CLI against a real local cluster (one daemon for the module, tests in order):
up from a config file, status (table and JSON), generate, rebalance 1P1D -> 2P1D -> 1P2D (the
last step by a role switch) under a steady stream of requests with none failing, drain, a
killed worker leaving and being replaced, a headless Locust run through `pdserve bench`
(issue 8), and down."""

from __future__ import annotations

import csv
import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from cli_harness import KV_BLOCKS, CliCluster

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def ids(cluster: CliCluster, role: str) -> list[str]:
    return sorted(w["worker_id"] for w in cluster.workers(role))


def roles(status: dict[str, Any]) -> Counter[str]:
    return Counter(w["role"] for w in status["workers"] if w["state"] == "WORKER_STATE_READY")


class SteadyStream:
    """Threads sending requests back to back through gRPC until stopped; every outcome kept."""

    def __init__(self, target: str, threads: int = 2) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.ok: list[tuple[float, str, str]] = []
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def _run(self, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            prompt = [10 + (n * 7919 + i * 104729 + k * 31) % 480 for k in range(40)]
            request = pb.GenerateRequest(
                token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True
            )
            try:
                last = None
                tokens = 0
                for msg in self.stub.Generate(request, timeout=120):
                    tokens += len(msg.token_ids)
                    last = msg
                assert last is not None and tokens == 6, f"{tokens} tokens"
                t = last.timings
                self.ok.append((time.monotonic(), t.prefill_worker, t.decode_worker))
            except grpc.RpcError as e:
                self.failed.append(f"{e.code().name}: {e.details()}")
            except AssertionError as e:
                self.failed.append(str(e))

    def __enter__(self) -> SteadyStream:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)
        self.channel.close()

    def served_since(self, t0: float) -> list[tuple[float, str, str]]:
        return [r for r in self.ok if r[0] >= t0]

    def wait_served(self, n: int, since: float, within_s: float, what: str) -> None:
        """Until `n` requests have finished since `since` (monotonic seconds)."""
        deadline = time.monotonic() + within_s
        while len(self.served_since(since)) < n:
            assert time.monotonic() < deadline, f"{what}: {self.failed[-3:]}"
            time.sleep(0.1)


def test_up_detached_from_config_file_with_flags_winning(cli_cluster: CliCluster) -> None:
    out = cli_cluster.up_output
    assert "pdserve is up" in out and cli_cluster.target in out
    state = cli_cluster.state()
    assert state["ray_address"].startswith("127.0.0.1:")  # a local Ray on loopback
    assert not state["ray_external"]
    status = cli_cluster.status()
    assert roles(status) == {"prefill": 1, "decode": 1}  # --prefill 1 beat the file's 2
    assert {w["kv_blocks_total"] for w in status["workers"]} == {KV_BLOCKS}  # engine: from file
    assert status["thresholds"]["local_prefill_threshold_tokens"] == 0  # thresholds: from file


def test_status_json_has_role_node_device_health_kv_queue_transfers(
    cli_cluster: CliCluster,
) -> None:
    status = cli_cluster.status()
    assert status["redis_ok"] is True
    for w in status["workers"]:
        assert w["state"] == "WORKER_STATE_READY"
        assert len(w["node"]) == 56  # a Ray node id (hex)
        assert w["device"] == "cpu"
        for key in ("kv_blocks_used", "queued_requests", "inflight_transfers", "ttft_p50_ms",
                    "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "running_requests"):  # fmt: skip
            assert key in w
    # The control log follows the controller about once a second.
    cli_cluster.wait_for(
        lambda st: any("ready on cpu" in line for line in st["events"]), 10, "worker events"
    )


def test_generate_streams_then_status_table_shows_latency(cli_cluster: CliCluster) -> None:
    result = cli_cluster.cli(
        "generate", "The lighthouse keeper writes", "--max-tokens", "8", "--ignore-eos"
    )
    assert result.exit_code == 0, result.output
    assert "TTFT" in result.output and "prefill prefill-" in result.output
    # the control log follows the controller about once a second (later on a loaded machine)
    cli_cluster.wait_for(
        lambda st: any("worker prefill-0 (prefill) ready" in e for e in st["events"]),
        30,
        "prefill-0's ready event",
    )
    table = cli_cluster.cli("status")
    assert table.exit_code == 0, table.output
    header = table.output.splitlines()[2]
    for column in ("worker", "role", "health", "node", "device", "KV used", "queue", "xfer",
                   "TTFT p50/90 ms", "TPOT p50/90 ms"):  # fmt: skip
        assert column in header
    node = cli_cluster.workers("prefill")[0]["node"][:8]
    assert node in table.output and "ready" in table.output
    assert "worker prefill-0 (prefill) ready" in table.output  # the controller's events
    prefill = cli_cluster.workers("prefill")[0]
    assert prefill["ttft_p50_ms"] > 0


def test_generate_verbose_prints_the_timings_the_answer_carries(cli_cluster: CliCluster) -> None:
    result = cli_cluster.cli(
        "generate", "The lighthouse keeper writes", "--max-tokens", "6", "--ignore-eos", "-v"
    )
    assert result.exit_code == 0, result.output
    out = result.output
    (prefill,), (decode,) = ids(cli_cluster, "prefill"), ids(cli_cluster, "decode")
    for stage in ("admission queue", "prefill", "KV transfer", "TTFT", "TPOT (mean)",
                  "end to end", "this client"):  # fmt: skip
        assert stage in out, stage
    assert "request " in out and "6 generated" in out and "disaggregated" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert prefill in rows["prefill"] and decode in rows["KV"]
    assert float(rows["TTFT"].split()[1]) > 0


def test_status_watch_refreshes_count_times_on_a_pipe(cli_cluster: CliCluster) -> None:
    started = time.monotonic()
    result = cli_cluster.cli("status", "--watch", "--interval", "0.3", "--count", "3")
    assert result.exit_code == 0, result.output
    assert result.output.count("pdserve status · every 0.3 s") == 3
    assert result.output.count("redis ok") == 3  # the table's title, once per refresh
    assert time.monotonic() - started >= 0.6  # two waits between three refreshes
    refused = cli_cluster.cli("status", "--watch", "--interval", "0")
    assert refused.exit_code == 2 and "--interval" in refused.output


def test_status_watch_redraws_in_place_on_a_terminal_until_ctrl_c(
    cli_cluster: CliCluster,
) -> None:
    import os
    import pty
    import select
    import signal
    import subprocess
    import sys

    leader, follower = pty.openpty()
    env = {**os.environ, **cli_cluster.env, "TERM": "xterm", "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli.app", "status", "--watch", "--interval", "0.3"],
        stdin=follower, stdout=follower, stderr=follower, env=env, close_fds=True,
    )  # fmt: skip
    os.close(follower)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while seen.count(b"pdserve status") < 3 and time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                seen += os.read(leader, 65536)
        assert seen.count(b"pdserve status") >= 3, seen.decode(errors="replace")
        proc.send_signal(signal.SIGINT)
        # keep draining the terminal while it exits: a full pty buffer would block its last
        # redraw (and so its exit) on a write nobody reads
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, "status --watch did not exit on Ctrl-C"
            if select.select([leader], [], [], 0.2)[0]:
                try:
                    seen += os.read(leader, 65536)
                except OSError:  # the terminal closed with the process
                    break
            elif proc.poll() is not None:  # exited, and all it wrote is read
                break
        rc = proc.wait(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        os.close(leader)
    text = seen.decode(errors="replace")
    assert rc == 0, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert "\x1b[2K" in text and "\x1b[1A" in text  # the live table moves the cursor up


def test_thresholds_shows_and_sets_zero_at_run_time(cli_cluster: CliCluster) -> None:
    shown = cli_cluster.cli("thresholds")
    assert shown.exit_code == 0, shown.output
    before = dict(line.split() for line in shown.output.strip().splitlines())
    assert set(before) == {
        "max_estimated_ttft_ms",
        "max_queue_wait_ms",
        "max_inflight_requests",
        "max_decode_kv_utilization",
        "local_prefill_threshold_tokens",
    }
    changed = cli_cluster.cli("thresholds", "--max-queue-wait-ms", "0")
    assert changed.exit_code == 0, changed.output
    after = dict(line.split() for line in changed.output.strip().splitlines())
    assert after["max_queue_wait_ms"] == "0"
    assert {k: v for k, v in after.items() if k != "max_queue_wait_ms"} == {
        k: v for k, v in before.items() if k != "max_queue_wait_ms"
    }
    bad = cli_cluster.cli("thresholds", "--max-decode-kv-utilization", "2")
    assert bad.exit_code == 1 and "INVALID_ARGUMENT" in bad.output
    assert "max_decode_kv_utilization" in bad.output
    restored = cli_cluster.cli("thresholds", "--max-queue-wait-ms", before["max_queue_wait_ms"])
    assert restored.exit_code == 0, restored.output


def test_rebalance_under_steady_load_loses_no_request(cli_cluster: CliCluster) -> None:
    (old_prefill,) = ids(cli_cluster, "prefill")
    (old_decode,) = ids(cli_cluster, "decode")
    with SteadyStream(cli_cluster.target) as stream:
        stream.wait_served(4, 0.0, 60, "no steady load before the rebalance")
        result = cli_cluster.cli("rebalance", "--prefill", "2", "--decode", "1")
        assert result.exit_code == 0, result.output
        # A new worker is READY in status once the router polled its load (~50 ms).
        cli_cluster.wait_for(
            lambda st: roles(st) == {"prefill": 2, "decode": 1}, 10, "2P1D in status"
        )
        (new_prefill,) = set(ids(cli_cluster, "prefill")) - {old_prefill}
        t_2p1d = time.monotonic()
        deadline = time.monotonic() + 30
        while not any(p == new_prefill for _, p, _ in stream.served_since(t_2p1d)):
            assert time.monotonic() < deadline, "the new prefill worker got no request"
            time.sleep(0.2)

        result = cli_cluster.cli("rebalance", "--prefill", "1", "--decode", "2")
        assert result.exit_code == 0, result.output
        # drained, then switched to decode in place (no restart): the new decode worker
        assert f"(switched ['{new_prefill}'] in place)" in result.output
        cli_cluster.wait_for(
            lambda st: roles(st) == {"prefill": 1, "decode": 2}, 10, "1P2D in status"
        )
        (new_decode,) = set(ids(cli_cluster, "decode")) - {old_decode}
        t_1p2d = time.monotonic()
        deadline = time.monotonic() + 30
        while not any(d == new_decode for _, _, d in stream.served_since(t_1p2d)):
            assert time.monotonic() < deadline, "the new decode worker got no request"
            time.sleep(0.2)
        stream.wait_served(4, time.monotonic(), 60, "no steady load after the rebalance")
    assert stream.failed == []
    assert len(stream.ok) >= 10
    assert ids(cli_cluster, "prefill") == [old_prefill]


def test_drain_stops_a_worker_and_it_leaves_status(cli_cluster: CliCluster) -> None:
    decodes = ids(cli_cluster, "decode")
    assert len(decodes) == 2
    victim = decodes[-1]
    result = cli_cluster.cli("drain", victim, "--timeout", "60")
    assert result.exit_code == 0, result.output
    assert f"{victim} drained (0 requests finished) and stopped" in result.output
    cli_cluster.wait_for(
        lambda st: victim not in {w["worker_id"] for w in st["workers"]}, 10, f"{victim} gone"
    )
    unknown = cli_cluster.cli("drain", "decode-404")
    assert unknown.exit_code == 1 and "NOT_FOUND" in unknown.output


def test_killed_worker_leaves_status_within_seconds_and_is_replaced(
    cli_cluster: CliCluster,
) -> None:
    (victim,) = ids(cli_cluster, "decode")
    killed_at = cli_cluster.ray_kill(f"pdserve-worker-{victim}")
    cli_cluster.wait_for(
        lambda st: victim not in {w["worker_id"] for w in st["workers"]},
        10,
        f"killed {victim} gone from status",
    )
    gone_after = time.time() - killed_at
    assert gone_after < 10
    status = cli_cluster.wait_for(
        lambda st: (
            roles(st)["decode"] == 1
            and any("replaced a dead decode worker" in e for e in st["events"])
        ),
        120,
        "a replacement decode worker ready",
    )
    replaced_after = time.time() - killed_at
    (replacement,) = [w["worker_id"] for w in status["workers"] if w["role"] == "decode"]
    assert replacement != victim
    assert any(f"worker {victim} is dead; removed from placement" in e for e in status["events"])
    assert any(f"replaced a dead decode worker with {replacement}" in e for e in status["events"])
    result = cli_cluster.cli("generate", "after the replacement", "--max-tokens", "4")
    assert result.exit_code == 0, result.output
    assert f"decode {replacement}" in result.output
    print(f"killed {victim}: gone from status after {gone_after:.1f}s, "
          f"{replacement} ready after {replaced_after:.1f}s")  # fmt: skip


def test_bench_runs_locust_headless_with_ttft_tpot_and_no_failures(
    cli_cluster: CliCluster, tmp_path: Path
) -> None:
    profile = tmp_path / "tiny.yaml"
    profile.write_text(
        yaml.safe_dump(
            {
                "name": "tiny",
                "kind": "synthetic",
                "seed": 0,
                "vocab": {"low": 10, "high": 500},
                "prompt_tokens": {"median": 24, "sigma": 0.3, "min": 8, "max": 64},
                "output_tokens": {"median": 6, "sigma": 0.2, "min": 4, "max": 10},
                "arrival": {"process": "poisson"},
                "temperature": 0.0,
            }
        )
    )
    out = tmp_path / "bench"
    result = cli_cluster.cli(
        "bench", "--profile", str(profile), "--rate", "3", "--duration", "3",
        "--num-requests", "8", "--slo", "ttft:5000", "--slo", "tpot:1000", "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["used_locust"] is True
    (report,) = summary["reports"]
    assert report["requests"] == 8 and report["failed"] == 0 and report["completed"] == 8
    with (out / "rate-3" / "locust_stats.csv").open() as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    for name in ("TTFT", "TPOT"):
        assert int(rows[name]["Request Count"]) == 8, rows[name]
        assert int(rows[name]["Failure Count"]) == 0
        assert float(rows[name]["Average Response Time"]) > 0
    assert int(rows["Aggregated"]["Failure Count"]) == 0
    assert (out / "rate-3" / "locust.html").exists()


def test_down_stops_the_daemon_and_its_cluster(cli_cluster: CliCluster) -> None:
    from deploy.cli.daemon import _alive

    pid = cli_cluster.state()["pid"]
    target = cli_cluster.target
    result = cli_cluster.cli("down", "--timeout", "90")
    assert result.exit_code == 0, result.output
    assert f"stopped pdserve (pid {pid})" in result.output
    assert not cli_cluster.state_file.exists()
    assert not _alive(pid)
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.FutureTimeoutError):
        grpc.channel_ready_future(channel).result(timeout=2)
    again = cli_cluster.cli("down")
    assert again.exit_code == 0 and "no pdserve cluster is running" in again.output
