"""A short chaos run, as an operator starts it (`pdserve chaos`, its own local Ray, embedded
Redis, 2 prefill + 2 decode workers): open-loop load at twice the measured capacity while a
decode worker, then a prefill worker, then a decode worker again are killed, Redis restarts
and clients cancel or run out of their deadlines. Hard assertions on what the run read back:
no request lost, hung or ended with a status outside the expected ones, no token different
from the undisturbed greedy run, every running request on a killed decode worker migrated,
every killed worker replaced, and every worker's pools and lease tables back at baseline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]


def test_a_short_chaos_run_loses_nothing_and_leaks_nothing(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = {
        "model": str(tiny_model_dir),
        "prefill": 2,
        "decode": 2,
        "grpc_port": 0,
        "metrics_port": 0,
        "router": {"admin_port": 0, "http_port": 0},  # free ports: other clusters may run here
        "engine": {"device": "cpu", "dtype": "float32", "num_kv_blocks": 160,
                   "max_model_len": 512, "attention_backend": "torch", "cuda_graphs": False},
        "placement": {"default": {"num_cpus": 0}},  # 4 workers + routers on 2 cores
        "thresholds": {"local_prefill_threshold_tokens": 0},  # every prompt handed off
    }  # fmt: skip
    config_path = tmp_path / "pdserve.yaml"
    config_path.write_text(yaml.safe_dump(config))
    out = tmp_path / "chaos"
    env = {**os.environ, "PDSERVE_STATE_FILE": str(tmp_path / "run" / "cluster.json")}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli.app", "chaos", "--config", str(config_path),
         "--duration", "24", "--load", "2", "--kill-every", "7", "--redis-restart-every", "11",
         "--cancel-share", "0.1", "--deadline-share", "0.05", "--max-tokens", "32",
         "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    report = json.loads((out / "chaos.json").read_text()) if (out / "chaos.json").exists() else {}
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    assert report["clean"], report
    assert report["unexpected"] == {} and report["token_mismatches"] == 0, report
    assert report["hung"] == 0 and report["leaked"] == {}, report
    assert report["completed"] > 50 and report["sent"] == sum(report["statuses"].values())
    assert report["statuses"].get("CANCELLED", 0) > 0, report["statuses"]
    roles = [k["role"] for k in report["kills"]]
    assert roles[:3] == ["decode", "prefill", "decode"], report["kills"]
    assert all(k["recovered_s"] is not None for k in report["kills"]), report["kills"]
    # the streams running on each killed decode worker went on elsewhere
    assert report["migrations"] >= 2, report
    assert report["migration_gap_p50_ms"] is not None, report
    assert report["redis_restarts"] >= 2, report
