"""`python -m benchmarks goodput --modes colocated,pd,split`: each mode's cluster, and the
table that sets them side by side (no cluster started here)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.suites import goodput
from vocabulary.worker_api import WorkerRole


def args(**kw: object) -> argparse.Namespace:
    base = dict(
        token_budget=2048, colocated_budget=0, num_kv_blocks=0, quantization="none",
        kv_cache_dtype="auto", load_format="dummy", gpu_fraction=0.5, colocated_workers=1,
    )  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_each_mode_runs_its_own_roles_on_the_same_engine() -> None:
    roles = {
        mode: goodput.cluster_options(mode, "/m", args()).workers.initial_roles()
        for mode in goodput.MODES
    }
    assert roles["pd"] == [WorkerRole.PREFILL, WorkerRole.DECODE]
    assert roles["colocated"] == [WorkerRole.COLOCATED]
    assert roles["split"] == [WorkerRole.SPLIT]
    with pytest.raises(ValueError, match="--modes"):
        goodput.cluster_options("disagg", "/m", args())


def test_colocated_budget_sets_only_the_colocated_engines_chunk() -> None:
    def budget(mode: str, **kw: object) -> int:
        spec = goodput.cluster_options(mode, "/m", args(**kw)).workers
        return spec.engine.max_num_batched_tokens

    assert budget("colocated") == 2048  # 0: --token-budget
    assert budget("colocated", colocated_budget=1024) == 1024
    assert budget("pd", colocated_budget=1024) == 2048
    assert budget("split", colocated_budget=1024) == 2048


def test_the_table_sets_split_and_pd_against_colocated(capsys: pytest.CaptureFixture[str]) -> None:
    table = {
        "prefill_heavy": {
            "pd": {"goodput_chat": 4.0, "goodput_tight": 2.0},
            "colocated": {"goodput_chat": 8.0, "goodput_tight": 4.0},
            "split": {"goodput_chat": 10.0, "goodput_tight": None},
            "ratio_chat": 0.5, "ratio_tight": 0.5, "ratio_split_chat": 1.25,
            "ratio_split_tight": None,
        },
        "kv_transfer": {"gbps": 0.1}, "peer_copy_gbps": 0.0,
    }  # fmt: skip
    goodput.print_table(table, argparse.Namespace(workloads=["prefill_heavy"]))
    out = capsys.readouterr().out
    assert "split/coloc" in out
    chat = next(line for line in out.splitlines() if " chat " in f" {line} ")
    assert chat.split()[2:] == ["4", "8", "10", "0.50x", "1.25x"]
    tight = next(line for line in out.splitlines() if " tight " in f" {line} ")
    assert tight.split()[2:] == ["2", "4", "-", "0.50x", "-"]
