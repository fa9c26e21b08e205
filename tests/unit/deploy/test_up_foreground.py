"""A foreground `pdserve up` stops the cluster it started whatever fails after the start
(the state file, the endpoint's printout, the signal wait), not only on Ctrl-C."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from deploy.cli import app, daemon


class FakeCluster:
    """Stands in for deploy.control.launch.Cluster: records start and stop."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.access = SimpleNamespace(admin_key="")
        self.calls: list[str] = []
        FakeCluster.last = self

    last: FakeCluster

    def start(self) -> Any:
        self.calls.append("start")
        return SimpleNamespace(
            grpc=("127.0.0.1:1",), metrics=(), redis_url="redis://x", model_dir="/m",
            ray_address="", admin=("127.0.0.1:2",),
        )  # fmt: skip

    def stop(self) -> None:
        self.calls.append("stop")


def test_a_failure_after_the_start_stops_the_cluster(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PDSERVE_STATE_FILE", str(tmp_path / "cluster.json"))
    monkeypatch.setattr("deploy.control.launch.Cluster", FakeCluster)

    def broken_write(state: daemon.ClusterState) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(daemon, "write_state", broken_write)
    config = SimpleNamespace(
        cluster=SimpleNamespace(address=None, name="pdserve"),
        router=SimpleNamespace(tls=SimpleNamespace(cert_file="")),
    )
    with pytest.raises(OSError, match="No space"):
        app._run_foreground(config, None)  # type: ignore[arg-type]
    assert FakeCluster.last.calls == ["start", "stop"]
    assert not (tmp_path / "cluster.json").exists()


def test_the_state_names_what_the_cluster_started(tmp_path: Path) -> None:
    cluster = FakeCluster(
        SimpleNamespace(
            cluster=SimpleNamespace(address="ray://head:10001", name="prod"),
            router=SimpleNamespace(tls=SimpleNamespace(cert_file="/tls/ca.pem")),
        )
    )
    state = daemon.foreground_state(cluster, cluster.start(), None, tmp_path / "c.log")
    assert state.targets == ["127.0.0.1:1"] and state.admin_targets == ["127.0.0.1:2"]
    assert state.ray_external and state.cluster_name == "prod"
    assert state.control_log == str(tmp_path / "c.log") and state.log == ""
