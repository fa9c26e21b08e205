"""What `pdserve up` decides about access before anything starts (deploy/control/security.py): no
router beyond loopback without API keys (unless --insecure), keys that do not load refused
naming the line, the CLI's admin key, TLS files checked, and the block hash beyond loopback.
Each refusal is one line with exit code 2; nothing is started."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from deploy.cli.app import app
from deploy.control.config_tree import LaunchConfig, PdserveConfig
from deploy.control.security import (
    SecurityError,
    cluster_access,
    exposure_refusal,
    is_loopback,
    resolve_block_hash,
)
from router.auth import key_digest
from router.router_server import RouterConfig
from router.tls import TlsConfig
from vocabulary.block_hash import HashAlgorithm

KEY = "tenant-key-0123456789"


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    started: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        started.append(args)
        raise RuntimeError("stub: nothing starts in a unit test")

    monkeypatch.setattr("deploy.control.launch.Cluster.start", refuse)
    monkeypatch.setattr("deploy.cli.daemon.spawn_detached", refuse)
    return started


def up(tmp_path: Path, *args: str, **env: str) -> Any:
    env = {"PDSERVE_STATE_FILE": str(tmp_path / "cluster.json"), "PDSERVE_API_KEYS": "",
           "PDSERVE_ADMIN_KEY": "", **env}  # fmt: skip
    return CliRunner().invoke(app, ["up", "--detach", *args], env=env)


@pytest.mark.parametrize(
    ("args", "flag"),
    [(["--host", "0.0.0.0"], "--host 0.0.0.0"), (["--admin-host", "10.1.2.3"], "--admin-host")],
)
def test_up_beyond_loopback_without_keys_is_refused(
    tmp_path: Path, started: list[Any], args: list[str], flag: str
) -> None:
    result = up(tmp_path, *args)
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: {flag}")
    assert "needs API keys" in result.output and "--insecure" in result.output
    assert started == []


def test_up_beyond_loopback_goes_on_with_keys_or_insecure(
    tmp_path: Path, started: list[Any]
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY} acme\n")
    for args in (["--api-keys-file", str(keys)], ["--insecure"]):
        result = up(tmp_path, "--host", "0.0.0.0", *args)
        assert "needs API keys" not in result.output
        assert len(started) == 1, result.output  # got past the checks to the (stub) start
        started.clear()
    result = up(tmp_path, "--host", "0.0.0.0", PDSERVE_API_KEYS=f"{KEY} acme")
    assert len(started) == 1, result.output


def test_a_bad_key_file_is_refused_naming_its_line_never_the_key(
    tmp_path: Path, started: list[Any]
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY} acme\nshort-key globex\n")
    result = up(tmp_path, "--api-keys-file", str(keys))
    assert result.exit_code == 2 and started == []
    assert result.output.startswith(f"error: {keys}:2: a key must be 16 to 256"), result.output
    assert KEY not in result.output and "short-key" not in result.output


def test_tls_files_are_checked_before_anything_starts(tmp_path: Path, started: list[Any]) -> None:
    result = up(tmp_path, "--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", "x")
    assert result.exit_code == 2 and started == []
    assert result.output.startswith("error: --tls-cert:")
    result = up(tmp_path, "--tls-cert", str(tmp_path / "missing.pem"))
    assert result.output.startswith("error: --tls-key: TLS needs both"), result.output


def test_the_admin_key_is_the_environment_s_or_generated_once_keys_are_on() -> None:
    config = PdserveConfig()
    assert not cluster_access(config, {}).enabled
    env = {"PDSERVE_API_KEYS": f"{KEY} acme"}
    access = cluster_access(config, env)
    assert access.enabled and len(access.admin_key) >= 32
    assert [(k.tenant, k.admin) for k in access.keys] == [("acme", False), ("admin", True)]
    assert access.keys[1].digest == key_digest(access.admin_key)
    assert access.admin_key not in repr(access)
    mine = cluster_access(config, {**env, "PDSERVE_ADMIN_KEY": "my-admin-key-0123456"})
    assert mine.admin_key == "my-admin-key-0123456"
    with pytest.raises(SecurityError, match="listed as a tenant key"):
        cluster_access(config, {**env, "PDSERVE_ADMIN_KEY": KEY})
    with pytest.raises(SecurityError, match="PDSERVE_ADMIN_KEY: a key must be"):
        cluster_access(config, {**env, "PDSERVE_ADMIN_KEY": "short"})


def test_block_hash_auto_is_sha256_beyond_loopback() -> None:
    assert resolve_block_hash(PdserveConfig()) is HashAlgorithm.XXH3
    exposed = PdserveConfig(router=RouterConfig(host="0.0.0.0"))
    assert resolve_block_hash(exposed) is HashAlgorithm.SHA256
    chosen = PdserveConfig(cluster=LaunchConfig(block_hash="xxh3"), router=exposed.router)
    assert resolve_block_hash(chosen) is HashAlgorithm.XXH3
    assert [is_loopback(h) for h in ("127.0.0.1", "127.9.9.9", "::1", "localhost")] == [True] * 4
    assert [is_loopback(h) for h in ("0.0.0.0", "10.0.0.1", "example.com", "::")] == [False] * 4


def test_exposure_refusal_passes_a_loopback_cluster_without_keys() -> None:
    assert exposure_refusal(PdserveConfig(), cluster_access(PdserveConfig(), {})) is None
    tls = PdserveConfig(router=RouterConfig(tls=TlsConfig(client_ca_file="ca.pem")))
    refusal = exposure_refusal(tls, cluster_access(tls, {}))
    assert refusal is not None and refusal.startswith("--tls-client-ca: mutual TLS needs")
