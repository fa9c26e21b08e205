"""`pdserve up --detach` with API keys, as an operator runs it: the admin key lands in the state
file (0600) and the other commands use it; `generate` with a tenant key is served as that
tenant and shows no worker; no key or password is printed by `up` or `status --json`; `down`.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator

import grpc
import pytest
import yaml
from cli_harness import KV_BLOCKS, MAX_MODEL_LEN, CliCluster, free_port

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TENANT_KEY = "cli-tenant-key-0123456789"


@pytest.fixture(scope="module")
def secure_cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliCluster]:
    folder = tmp_path_factory.mktemp("pdserve-cli-secure")
    keys = folder / "api-keys"
    keys.write_text(f"{TENANT_KEY} acme\n")
    config = {
        "prefill": 1, "decode": 1, "grpc_port": free_port(), "metrics_port": 0,
        "router": {"admin_port": 0, "http_port": 0},
        "engine": {"device": "cpu", "dtype": "float32", "num_kv_blocks": KV_BLOCKS,
                   "max_model_len": MAX_MODEL_LEN, "attention_backend": "torch",
                   "cuda_graphs": False},
        "placement": {"default": {"num_cpus": 0}},
    }  # fmt: skip
    config_path = folder / "pdserve.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = {"PDSERVE_STATE_FILE": str(folder / "run" / "cluster.json"), "PDSERVE_ADMIN_KEY": "",
           "PDSERVE_API_KEYS": "", "PDSERVE_API_KEY": ""}  # fmt: skip
    cluster = CliCluster(folder, config_path, env, "")
    result = cluster.cli(
        "up", "--detach", "--config", str(config_path), "--api-keys-file", str(keys),
        "--timeout", "400",
    )  # fmt: skip
    log = folder / "run" / "pdserve-up.log"
    assert result.exit_code == 0, result.output + (log.read_text() if log.exists() else "")
    cluster.up_output = result.output
    try:
        yield cluster
    finally:
        from deploy.cli import daemon

        os.environ["PDSERVE_STATE_FILE"] = env["PDSERVE_STATE_FILE"]
        try:
            daemon.stop_cluster(60)
        finally:
            del os.environ["PDSERVE_STATE_FILE"]


def test_up_keeps_the_admin_key_in_a_private_state_file_and_prints_no_secret(
    secure_cli: CliCluster,
) -> None:
    state = secure_cli.state()
    assert len(state["admin_key"]) >= 32 and state["admin_targets"]
    assert stat.S_IMODE(secure_cli.state_file.stat().st_mode) == 0o600
    password = state["redis_url"].split("@")[0].rsplit(":", 1)[1]
    out = secure_cli.up_output
    assert "admin" in out and "***@" in out
    for secret in (state["admin_key"], password, TENANT_KEY):
        assert secret not in out
    status = secure_cli.status()  # through the admin plane, with the state file's key
    assert {w["role"] for w in status["workers"]} == {"prefill", "decode"}
    dumped = json.dumps(status)
    assert state["admin_key"] not in dumped and password not in dumped


def test_the_admin_plane_refuses_a_tenant_key_and_the_data_plane_no_key(
    secure_cli: CliCluster,
) -> None:
    state = secure_cli.state()
    with grpc.insecure_channel(state["admin_targets"][0]) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.AdminStub(channel).Status(
                pb.StatusRequest(), metadata=(("authorization", f"Bearer {TENANT_KEY}"),),
                timeout=10,
            )  # fmt: skip
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    denied = secure_cli.cli("status", "--json")
    assert denied.exit_code == 0  # the CLI's own key works
    env = dict(secure_cli.env, PDSERVE_ADMIN_KEY=TENANT_KEY)
    from typer.testing import CliRunner

    from deploy.cli.app import app

    refused = CliRunner().invoke(app, ["status"], env=env)
    assert refused.exit_code == 1 and "PERMISSION_DENIED" in refused.output


def test_generate_with_a_tenant_key_names_no_worker(secure_cli: CliCluster) -> None:
    from typer.testing import CliRunner

    from deploy.cli.app import app

    env = dict(secure_cli.env, PDSERVE_API_KEY=TENANT_KEY)
    out = CliRunner().invoke(app, ["generate", "The river", "--max-tokens", "4"], env=env)
    assert out.exit_code == 0, out.output
    assert "(not shown)" in out.output and "decode-" not in out.output  # a tenant's view
    admin = secure_cli.cli("generate", "The river", "--max-tokens", "4")  # the admin key
    assert admin.exit_code == 0 and "decode-" in admin.output, admin.output


def test_down_stops_it(secure_cli: CliCluster) -> None:
    result = secure_cli.cli("down", "--timeout", "60")
    assert result.exit_code == 0, result.output
    assert not secure_cli.state_file.exists()
