"""`python -m benchmarks tp_gpu --cpu`: the GPU suite's own code end to end on the CPU (the
tiny model; TP ranks over gloo; every hand-off rank its own process with a host pool and a
NIXL agent over UCX shm/tcp), so the script a two-GPU machine runs has run somewhere: both
decode runs report, TP=2's logits agree with TP=1's, the floors' arithmetic matches the
models built, every pulled head and layer arrives intact (TP pairs, and a PP=2 prefill worker
to a TP=2 decode worker: each decode rank reads each stage's layers from the rank holding
them), descriptors match kv_transfer/tp_plan.py's count, and the script exits 0. Its figures
are not measurements."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]

ROOT = Path(__file__).resolve().parents[3]


def run_bench(args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"UCX_TLS": "shm,tcp", "UCX_NET_DEVICES": "lo"}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", "tp_gpu", *args.split()],
        capture_output=True, text=True, timeout=640, env=env, cwd=ROOT,
    )  # fmt: skip


def test_cpu_run_of_both_parts_passes_its_checks() -> None:
    args = "--cpu --batches 1,2 --context 64 --iters 2 --pairs 1-2,2-1,pp2tp1:pp1tp2 --repeats 2"
    done = run_bench(args + " --prompt-tokens 256 --part-timeout 300")
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-4000:]
    assert "every part that ran passed its checks (0 skipped)" in out
    assert "FAILED" not in out and "-- skipped" not in out
    assert re.search(r"TP=2 vs TP=1: \|\|diff\|\| / \|\|TP=1\|\| = [0-9.]+ \(agree", out)
    decode = re.findall(r"^ *(\d+) +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ ", out,
                        re.M)  # fmt: skip
    assert decode == ["1", "2"]  # a row per batch with TP=1 and TP=2 columns
    # 256 tokens = 16 blocks; head-major: one descriptor per block per decode rank's slice
    assert re.search(r"^1->2 +head +cpu +[0-9.]+ +32 \(16/16\) +- .* yes$", out, re.M), out
    assert re.search(r"^2->1 +head +cpu +[0-9.]+ +32 \(32\) +32 .* yes$", out, re.M), out
    # 2 stages of 2 layers: each decode rank reads its head of each stage's layers, one
    # descriptor per block per stage
    assert "prefill PP=2 over 4 layers (bounds 0,2,4) x TP=1" in out
    assert re.search(r"^pp2tp1->pp1tp2 +head +cpu +[0-9.]+ +64 \(32/32\) +- .* yes$", out, re.M)


def test_one_device_runs_tp1_and_skips_tp2_saying_why() -> None:
    done = run_bench("--cpu --cpu-devices 1 --parts decode --batches 1 --context 32 --iters 1")
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-4000:]
    assert "skipped decode TP=2: needs 2 GPUs (one per rank), this machine has 1" in out
    assert "every part that ran passed its checks (1 skipped)" in out
    assert "== decode TP=1" in out and "== decode TP=2" not in out
    assert re.search(r"^ *B +TP=1 ms +floor +x +graphs$", out, re.M), out
