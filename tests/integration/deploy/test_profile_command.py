"""`pdserve profile --quick` on the tiny model (a few grid points, in seconds), then
`pdserve simulate` on the file it wrote."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from deploy.cli.app import app
from planner.perf_profile import load_perf_profile


def test_profile_of_the_tiny_model_is_read_back_and_simulated(tmp_path: Path) -> None:
    out = tmp_path / "tiny.json"
    result = CliRunner().invoke(app, ["profile", str(out), "--quick", "--num-kv-blocks", "256"])
    assert result.exit_code == 0, result.output
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
    assert all(p.step_s > 0 for p in (*profile.prefill, *profile.decode))
    result = CliRunner().invoke(
        app,
        ["simulate", "--profile", str(out), "--rate", "2", "--duration", "5",
         "--model", header.model_id],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "latency, ms" in result.output
