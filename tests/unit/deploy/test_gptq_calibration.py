"""GPTQ rounding (deploy/checkpoints/gptq_calibration.py) on small matrices: with inputs that
never correlate it is round-to-nearest; with correlated inputs its output error on them is
lower than round-to-nearest's; make-model refuses --calibrate outside INT4."""

from __future__ import annotations

from pathlib import Path

import torch
from typer.testing import CliRunner

from deploy.checkpoints.gptq_calibration import gptq_round
from deploy.cli.app import app
from engine.quantization.int4_linear import INT4_MAX


def round_to_nearest(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    groups = w.reshape(w.shape[0], -1, group)
    scale = (groups.abs().amax(dim=2) / INT4_MAX).clamp(min=1e-12)
    q = (groups / scale[..., None]).round().clamp(-INT4_MAX, INT4_MAX)
    return q.reshape(w.shape).long(), scale


def test_uncorrelated_inputs_give_round_to_nearest() -> None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    q, scale = gptq_round(w, torch.eye(64) * 3.0, 32)
    want_q, want_scale = round_to_nearest(w, 32)
    assert torch.equal(q, want_q) and torch.allclose(scale, want_scale)


def test_correlated_inputs_get_a_lower_output_error_than_round_to_nearest() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 128, generator=g)
    x = torch.randn(512, 8, generator=g) @ torch.randn(8, 128, generator=g)  # rank 8 + noise
    x += 0.05 * torch.randn(512, 128, generator=g)
    h = 2 * x.double().T @ x.double() / len(x)
    q, scale = gptq_round(w, h, 32)
    assert int(q.abs().max()) <= INT4_MAX
    dequantized = (q.reshape(32, -1, 32) * scale[..., None]).reshape(32, 128)
    rtn_q, rtn_scale = round_to_nearest(w, 32)
    rtn = (rtn_q.reshape(32, -1, 32) * rtn_scale[..., None]).reshape(32, 128)
    gptq_error = (x @ (w - dequantized).T).norm()
    rtn_error = (x @ (w - rtn).T).norm()
    assert gptq_error < 0.8 * rtn_error, (float(gptq_error), float(rtn_error))


def test_calibrate_is_refused_outside_int4(tmp_path: Path) -> None:
    args = ["make-model", str(tmp_path / "m"), "--quantization", "int8", "--calibrate"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0
    assert "--calibrate: only with --quantization int4 or gptq" in " ".join(result.output.split())
