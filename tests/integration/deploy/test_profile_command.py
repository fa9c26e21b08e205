"""`pdserve profile --quick` on the tiny model (a few grid points, in seconds), then
`pdserve simulate` on the file it wrote; the same with `--tp 2` (a follower rank in a process
of its own, gone afterwards), and a `--tp` that cannot run refused before anything starts."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deploy.cli.app import app
from planner.perf_profile import PerfProfile, load_perf_profile

QUICK = ("--quick", "--num-kv-blocks", "256")


@pytest.fixture(scope="module")
def tp1_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "tiny.json"
    result = CliRunner().invoke(app, ["profile", str(out), *QUICK])
    assert result.exit_code == 0, result.output
    return out


def children() -> list[tuple[int, str, str]]:
    """This process's child processes: (pid, state, command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == os.getpid():
            found.append((int(entry.name), state, cmdline))
    return found


@pytest.fixture
def new_children() -> Callable[[], list[tuple[int, str, str]]]:
    """The child processes (zombies too) this test left that were not there when it began:
    another test of the same pytest process may have left standing ones (a local Ray, a
    multiprocessing fork server); multiprocessing's resource tracker, which the first use of
    multiprocessing starts and which lives as long as this process, is left out."""
    before = {pid for pid, _, _ in children()}
    return lambda: [c for c in children() if c[0] not in before and "resource_tracker" not in c[2]]


def steps(profile: PerfProfile) -> list[float]:
    return [p.step_s for p in profile.prefill] + [d.step_s for d in profile.decode]


def test_profile_of_the_tiny_model_is_read_back_and_simulated(tp1_profile: Path) -> None:
    out = tp1_profile
    profile = load_perf_profile(out, dtype="float32")
    header = profile.header
    assert header.model_id.startswith("tiny-") and header.device == "cpu"
    assert (header.num_layers, header.hidden_size, header.block_size) == (4, 128, 16)
    assert header.torch_version and header.pdserve_version
    assert [p.batch_tokens for p in profile.prefill] == [16, 128, 32]
    assert [p.cached_tokens for p in profile.prefill] == [0, 0, 64]
    assert {(p.batch_size, p.context_tokens) for p in profile.decode} == {
        (1, 32), (4, 32), (1, 128), (4, 128),
    }  # fmt: skip
    assert all(s > 0 for s in steps(profile))
    result = CliRunner().invoke(
        app,
        ["simulate", "--profile", str(out), "--rate", "2", "--duration", "5",
         "--model", header.model_id],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "latency, ms" in result.output


def test_a_tp2_profile_runs_its_follower_rank_and_leaves_no_process(
    tp1_profile: Path, tmp_path: Path, new_children: Callable[[], list[tuple[int, str, str]]]
) -> None:
    out = tmp_path / "tp2.json"
    result = CliRunner().invoke(app, ["profile", str(out), *QUICK, "--tp", "2"])
    assert result.exit_code == 0, result.output
    assert new_children() == []  # the follower returned (or was killed) and was reaped
    tp1 = load_perf_profile(tp1_profile)
    tp2 = load_perf_profile(out, tensor_parallel_size=2, model_id=tp1.header.model_id)
    assert tp2.header.device == "cpu" and tp2.header.torch_threads == 1
    assert [(p.batch_tokens, p.cached_tokens) for p in tp2.prefill] == [
        (p.batch_tokens, p.cached_tokens) for p in tp1.prefill
    ]
    assert all(s > 0 for s in steps(tp2))
    # two ranks, each a core's work and all-reduces: other times (faster or slower: not
    # asserted on a machine of 2 cores)
    assert steps(tp2) != steps(tp1)


@pytest.mark.parametrize(
    ("tp", "why"),
    [("0", "must be >= 1, got 0"), ("3", "4 attention heads are not divisible by 3")],
)
def test_a_tp_size_that_cannot_run_is_refused_before_anything_starts(
    tmp_path: Path, tp: str, why: str, new_children: Callable[[], list[tuple[int, str, str]]]
) -> None:
    out = tmp_path / "never.json"
    result = CliRunner().invoke(app, ["profile", str(out), *QUICK, "--tp", tp])
    assert result.exit_code == 2
    assert "--tp: " in result.output and why in result.output
    assert not out.exists() and new_children() == []


def test_a_tp2_profile_that_fails_midway_still_stops_its_rank(
    new_children: Callable[[], list[tuple[int, str, str]]],
) -> None:
    from deploy.checkpoints.make_model import cached_tiny_model
    from deploy.cli.profiling import ProfileGrid, measure

    def fail_after_the_first_point(line: str) -> None:
        raise RuntimeError(f"failed after {line!r}")

    with pytest.raises(RuntimeError, match="failed after 'prefill 16 tokens"):
        measure(
            cached_tiny_model(), ProfileGrid.quick(), num_kv_blocks=256, tensor_parallel_size=2,
            say=fail_after_the_first_point,
        )  # fmt: skip
    assert new_children() == []
