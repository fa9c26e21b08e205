"""The tp_gpu suite's command line (`python -m benchmarks tp_gpu`): with no CUDA GPU it runs
nothing, says so and exits 2; bad arguments exit 2 naming the argument; the `--cpu` defaults
are the small ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.suites.tp.gpu import parse_args

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_without_a_gpu_it_says_so_and_exits_2() -> None:
    env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "tp_gpu"],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA GPU here, nothing run" in done.stdout
    assert "nvidia-h200-x2" in done.stdout
    assert "==" not in done.stdout  # no part started


def test_fewer_devices_than_a_part_needs_skip_it_saying_why_and_exit_0() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "tp_gpu", "--cpu", "--cpu-devices", "1", "--parts",
         "handoff"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.split("======== summary")[1]
    for pair in ("1->1", "1->2", "2->1", "2->2", "pp2tp1->pp1tp1", "pp2tp1->pp1tp2"):
        assert f"skipped hand-off {pair}: needs 2 GPUs" in summary
    assert "every part that ran passed its checks (6 skipped)" in summary
    assert "FAILED" not in done.stdout and "== hand-off" not in done.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--parts", "decode,nope"], "unknown part 'nope'"),
        (["--pairs", "2"], "PREFILL_TP-DECODE_TP"),
        (["--handoff-pairs", "pp2tp1-pp1tp1"], "--pairs/--handoff-pairs: pair 'pp2tp1-pp1tp1'"),
        (["--batches", "1,0"], "positive integers"),
        (["--iters", "0"], "--iters: must be >= 1"),
        (["--placement", "everywhere"], "invalid choice"),
        (["--cpu", "--cpu-devices", "-1"], "--cpu-devices: must be >= 0"),
    ],
)
def test_bad_arguments_exit_2_naming_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_gpu_and_cpu() -> None:
    gpu = parse_args([])
    assert (gpu.parts, gpu.tp, gpu.batches, gpu.context, gpu.iters) == (
        ("decode", "handoff"), 2, (1, 16, 64), 2048, 30,
    )  # fmt: skip
    assert [p.name for p in gpu.pairs] == [
        "1->1", "1->2", "2->1", "2->2", "pp2tp1->pp1tp1", "pp2tp1->pp1tp2"
    ]  # fmt: skip
    assert (gpu.prompt_tokens, gpu.repeats, gpu.placement) == (2048, 10, "auto")
    cpu = parse_args(["--cpu"])
    assert (cpu.batches, cpu.context, cpu.iters, cpu.repeats) == ((1, 4), 256, 3, 3)
    asked = parse_args(["--cpu", "--batches", "8", "--context", "512"])
    assert (asked.batches, asked.context) == ((8,), 512)
