"""The CLI finds the admin plane and its key in the state file `up` writes (or the
environment) and sends `authorization: Bearer KEY`, against a real gRPC Admin server on
loopback; the state file is readable by its user only; the key is never printed."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from typer.testing import CliRunner

from deploy.cli import daemon
from deploy.cli.app import app
from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc

ADMIN_KEY = "state-file-admin-key-0123456789"


class RecordingAdmin(pb_grpc.AdminServicer):
    def __init__(self) -> None:
        self.authorization: list[str | None] = []

    def Status(self, request: Any, context: grpc.ServicerContext) -> Any:
        metadata = dict(context.invocation_metadata())
        self.authorization.append(metadata.get("authorization"))
        return pb.ClusterStatus(model="tiny")


@pytest.fixture
def admin() -> Iterator[tuple[RecordingAdmin, str]]:
    servicer = RecordingAdmin()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_AdminServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def write_state(path: Path, admin_target: str, key: str) -> dict[str, str]:
    env = {"PDSERVE_STATE_FILE": str(path), "PDSERVE_ADMIN_KEY": ""}
    os.environ["PDSERVE_STATE_FILE"] = str(path)
    try:
        daemon.write_state(daemon.ClusterState(
            pid=os.getpid(), targets=["127.0.0.1:1"], metrics=[], redis_url="redis://:pw@h:1/0",
            model_dir="m", log="", admin_targets=[admin_target], admin_key=key,
        ))  # fmt: skip
    finally:
        del os.environ["PDSERVE_STATE_FILE"]
    return env


def test_status_goes_to_the_admin_plane_with_the_state_file_s_key(
    admin: tuple[RecordingAdmin, str], tmp_path: Path
) -> None:
    servicer, target = admin
    state = tmp_path / "cluster.json"
    env = write_state(state, target, ADMIN_KEY)
    assert stat.S_IMODE(state.stat().st_mode) == 0o600
    assert json.loads(state.read_text())["admin_key"] == ADMIN_KEY
    for args in (["status", "--json"], ["status", "--json", "--target", "127.0.0.1:1"]):
        # no --target, or the cluster's data target: its admin plane, with its key
        result = CliRunner().invoke(app, args, env=env)
        assert result.exit_code == 0, result.output
        assert ADMIN_KEY not in result.output
    assert servicer.authorization == [f"Bearer {ADMIN_KEY}"] * 2
    result = CliRunner().invoke(
        app, ["status", "--json"], env={**env, "PDSERVE_ADMIN_KEY": "e" * 20}
    )
    assert result.exit_code == 0, result.output
    assert servicer.authorization[-1] == f"Bearer {'e' * 20}"  # the environment wins


def test_a_target_of_no_known_cluster_gets_no_key(
    admin: tuple[RecordingAdmin, str], tmp_path: Path
) -> None:
    servicer, target = admin
    env = write_state(tmp_path / "cluster.json", "127.0.0.1:2", ADMIN_KEY)
    result = CliRunner().invoke(app, ["status", "--target", target], env=env)
    assert result.exit_code == 0, result.output
    assert servicer.authorization == [None]  # the state file's key is not sent elsewhere


def test_an_admin_call_to_a_data_port_says_where_the_admin_plane_is(tmp_path: Path) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # serves no Admin
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        env = {"PDSERVE_STATE_FILE": str(tmp_path / "none.json")}
        result = CliRunner().invoke(app, ["status", "--target", f"127.0.0.1:{port}"], env=env)
    finally:
        server.stop(0)
    assert result.exit_code == 1
    assert "UNIMPLEMENTED" in result.output and "--admin-port" in result.output


def test_the_control_log_is_made_with_its_folder_on_a_fresh_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a foreground `up` in a fresh container: no run/ folder yet (it crashed there once)
    monkeypatch.setenv("PDSERVE_STATE_FILE", str(tmp_path / "fresh" / "run" / "cluster.json"))
    log = daemon.new_control_log()
    assert log == tmp_path / "fresh" / "run" / "pdserve-control.log"
    assert log.read_text() == ""
    log.write_text("an event\n")
    assert daemon.new_control_log().read_text() == ""  # a new cluster starts an empty log
