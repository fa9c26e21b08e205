"""One real cluster for the CLI tests, started the way an operator starts it:
`pdserve up --detach --config FILE` (a daemon process with its own local Ray, embedded
redis-server, 1 prefill + 1 decode worker, one router on a free port), driven through the
typer app (`CliRunner`) with `PDSERVE_STATE_FILE` pointing into a temp folder, so nothing
clashes with another cluster on the machine. The module's last test runs `pdserve down`; the
fixture's teardown makes sure of it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import yaml
from cli_harness import KV_BLOCKS, MAX_MODEL_LEN, CliCluster, free_port


@pytest.fixture(scope="module")
def cli_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliCluster]:
    folder = tmp_path_factory.mktemp("pdserve-cli")
    config = {
        # prefill 2 here, --prefill 1 on the command line: the flag wins.
        "prefill": 2,
        "decode": 1,
        "grpc_port": free_port(),
        "metrics_port": 0,
        "engine": {
            "device": "cpu",
            "dtype": "float32",
            "num_kv_blocks": KV_BLOCKS,
            "max_model_len": MAX_MODEL_LEN,
            "attention_backend": "torch",
            "cuda_graphs": False,
        },
        # No CPU reservations: 2-4 workers + router + controller on a 2-core machine.
        "placement": {"default": {"num_cpus": 0}},
        "thresholds": {"local_prefill_threshold_tokens": 0},  # every prompt disaggregated
        "router": {"admin_port": 0, "http_port": 0},  # free ones: other clusters may run here
    }
    config_path = folder / "pdserve.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = {"PDSERVE_STATE_FILE": str(folder / "run" / "cluster.json")}
    cluster = CliCluster(folder, config_path, env, "")
    result = cluster.cli(
        "up", "--detach", "--config", str(config_path), "--prefill", "1", "--timeout", "400"
    )
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
