"""`pdserve simulate` from the command line: the bench table from a profile, and bad input as
one line and exit code 2, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sim_profiles import make_profile
from typer.testing import CliRunner

from deploy.cli.app import app


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["simulate", *args])
    assert not isinstance(result.exception, Exception) or isinstance(
        result.exception, SystemExit
    ), result.exception
    return result.exit_code, result.output


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    make_profile().save(path)
    return path


def test_simulate_prints_the_bench_tables(profile: Path) -> None:
    code, out = run(
        "--profile", str(profile), "--workload", "synthetic", "--rate", "2", "--rate", "4",
        "--duration", "5", "--prefill", "1", "--decode", "1",
    )  # fmt: skip
    assert code == 0, out
    assert "simulated 1P1D" in out and "TTFT" in out and "goodput" in out
    assert "p0" in out and "d0" in out


def test_simulate_runs_split_workers_and_pd_pairs_sharing_a_gpu(profile: Path) -> None:
    common = ("--profile", str(profile), "--rate", "2", "--duration", "3")
    code, out = run(*common, "--prefill", "0", "--decode", "0", "--split", "1")
    assert code == 0, out
    assert "simulated 1S" in out and "s0" in out
    code, out = run(*common, "--shared-device")
    assert code == 0, out
    assert "simulated 1P1D shared" in out


def test_simulate_runs_one_shard_and_scales_its_report(profile: Path) -> None:
    args = ("--profile", str(profile), "--rate", "8", "--duration", "5", "--prefill", "2",
            "--decode", "2")  # fmt: skip
    code, out = run(*args, "--shards", "2")
    assert code == 0, out
    assert "simulated 2P2D as 2 shards" in out
    assert "p0" in out and "p1" not in out  # the shard's workers alone


def test_simulate_suggests_shards_for_a_long_run_of_a_large_cluster(
    profile: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deploy.cli import sim_commands

    monkeypatch.setattr(sim_commands, "SHARD_HINT_REQUESTS", 30)  # so a short run counts as long
    args = ("--profile", str(profile), "--rate", "8", "--duration", "5", "--decode", "8")
    code, out = run(*args, "--prefill", "8")
    assert code == 0, out
    assert "--shards 2 simulates 1/2" in out  # the most that keep 4 of each role a shard
    for more in (("--prefill", "8", "--shards", "2"), ("--prefill", "4")):
        code, out = run(*args, *more)  # sharded already; a pool too small to shard
        assert code == 0, out
        assert "simulated whole" not in out


def test_simulate_says_where_prompts_were_prefilled_and_why(profile: Path) -> None:
    args = ["--profile", str(profile), "--workload", "synthetic", "--rate", "2", "--duration", "5"]
    code, out = run(*args, "--local-prefill-policy", "cost")
    assert code == 0, out
    assert "local prefill: cost" in out
    assert "local_cheaper" in out or "remote_cheaper" in out
    code, out = run(*args, "--local-prefill-threshold", "0")
    assert code == 0, out
    assert "local prefill: threshold" in out and "over_threshold" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "llama-3-8b"], "profile model_id: made for 'synthetic'"),
        (["--dtype", "bfloat16"], "profile dtype: made for 'float32'"),
        (["--workload", "nope"], "profile: unknown 'nope'"),
        (["--decode", "0"], "--decode / --colocated"),
        (["--rate", "0"], "--rate: must be > 0"),
        (["--slo", "ttft"], "ttft"),
        (["--local-prefill-policy", "fast"], "--local-prefill-policy: one of threshold, cost"),
        (["--stall-weight", "-1"], "--stall-weight: must be >= 0, got -1.0"),
        (["--split", "-1"], "--split: must be >= 0"),
        (["--split", "1", "--split-decode-sms", "132"], "--split-decode-sms: must be in"),
        (["--split", "1", "--shared-device"], "--shared-device: pairs"),
        (["--decode", "2", "--shared-device"], "--shared-device: one prefill worker per decode"),
        (["--shared-device", "--shared-device-slowdown", "0.5"], "--shared-device-slowdown"),
        (
            ["--prefill", "4", "--decode", "6", "--shards", "4"],
            "--shards: 4 does not divide every role's workers (prefill 4, decode 6)",
        ),
        (["--shards", "0"], "--shards: must be >= 1, got 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    profile: Path, args: list[str], message: str
) -> None:
    code, out = run("--profile", str(profile), "--duration", "2", *args)
    assert code == 2, out
    assert message in out
    assert "Traceback" not in out


def test_a_profile_that_does_not_parse_is_exit_code_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format_version": 1, "header": {}}))
    code, out = run("--profile", str(bad))
    assert code == 2 and "prefill: required" in out, out


def test_a_missing_profile_is_exit_code_2(tmp_path: Path) -> None:
    code, out = run("--profile", str(tmp_path / "none.json"))
    assert code == 2 and "cannot read" in out, out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent-model"], "--model: /nonexistent-model has no config.json"),
        (["--prefill-factor", "0"], "prefill_factor > 0"),
        (["--threads", "0"], "--threads: must be >= 1"),
        (["--load-format", "npz"], "--load-format: one of auto, dummy, got 'npz'"),
    ],
)
def test_profile_refuses_bad_options_before_measuring(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = CliRunner().invoke(app, ["profile", str(tmp_path / "p.json"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "p.json").exists()
