"""`python -m benchmarks`: with no suite (or --help) it lists every suite with where it runs and
what it measures; an unknown suite exits 2 naming it; every suite's --help works and names the
suite's command. The suite names are the commands docs/benchmarks.md quotes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.registry import BY_NAME, SUITES

ROOT = Path(__file__).resolve().parents[3]
NAMES = (
    "attention", "auth_tls", "block_hash", "detokenize", "engine", "engine_loop", "engine_step",
    "fp8", "goodput", "host_tier", "http", "int", "kv_transfer", "local_prefill", "lora",
    "planner", "pp",
    "role_switch", "router",
    "sim_scale", "simulator",
    "sm_partition",
    "split_goodput", "soak", "step_outliers", "structured", "tp", "tp_gpu", "tp_handoff",
    "tracing", "workers",
)  # fmt: skip


def door(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip


def test_the_registry_holds_exactly_the_documented_suites() -> None:
    assert tuple(s.name for s in SUITES) == NAMES
    assert all(s.summary and len(s.summary) <= 80 for s in SUITES)


@pytest.mark.parametrize("args", [(), ("--help",), ("-h",)])
def test_the_door_alone_lists_every_suite_with_its_device_and_summary(
    args: tuple[str, ...],
) -> None:
    done = door(*args)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m benchmarks SUITE [ARGS...]")
    listed = {}
    for line in done.stdout.split("suite ", 1)[1].splitlines()[1:]:
        name, rest = line.split(maxsplit=1)
        listed[name] = rest
    assert tuple(listed) == NAMES
    for name, rest in listed.items():
        suite = BY_NAME[name]
        assert rest.startswith(suite.where) and rest.endswith(suite.summary), (name, rest)
    assert listed["attention"].startswith("GPU ")
    assert listed["router"].startswith("CPU ")
    assert listed["engine"].startswith("GPU (CPU: --cpu)")


def test_an_unknown_suite_exits_2_naming_it() -> None:
    done = door("bench_router")
    assert done.returncode == 2
    assert "unknown suite 'bench_router'" in done.stderr
    assert "router " in done.stderr  # the list follows


HELP_EVERY_SUITE = """
import contextlib, io
from benchmarks.registry import SUITES, run

for suite in SUITES:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            run(suite.name, ["--help"])
            code = "returned"
        except SystemExit as e:
            code = e.code
    print(f"=== {suite.name} {code}")
    print(out.getvalue())
"""


@pytest.mark.timeout(280)
def test_every_suite_help_names_its_command_and_exits_0() -> None:
    """One process for all 20 (the suites share their heavy imports: torch, ray, the engine)."""
    done = subprocess.run(
        [sys.executable, "-c", HELP_EVERY_SUITE],
        capture_output=True, text=True, timeout=270, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    sections = dict(
        part.split("\n", 1) for part in done.stdout.split("=== ")[1:]
    )  # "NAME CODE" -> help text
    assert [head.split()[0] for head in sections] == list(NAMES)
    for head, text in sections.items():
        name, code = head.split()
        assert code == "0", (name, code, text[-500:])
        assert text.startswith(f"usage: python -m benchmarks {name} "), (name, text[:200])
        assert "--help" in text


def test_a_suite_keeps_its_arguments_and_defaults() -> None:
    """A suite's command line is its old script's: a bad value exits 2 naming the argument."""
    done = door("block_hash", "--rounds", "x")
    assert done.returncode == 2
    assert "usage: python -m benchmarks block_hash [-h] [--rounds ROUNDS]" in done.stderr
    assert "argument --rounds: invalid int value: 'x'" in done.stderr
