"""TEST-ONLY: run a test module's Triton launches in Triton's interpreter, in a subprocess.

Whether a Triton kernel is interpreted is fixed when it is defined (`triton.jit` reads
TRITON_INTERPRET at import), and a pytest process may hold compiled ones (the GPU tests), so
interpreted launches run in a fresh interpreter: the test pickles its inputs, the subprocess
imports the test module and calls its `run_interpreted(inputs, outputs)`, which writes the
results back.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

TESTS = Path(__file__).resolve().parent


def interpret(module_file: str, inputs: Any, tmp_path: Path, timeout_s: float = 240) -> Any:
    """What `run_interpreted` of the test module at `module_file` writes for `inputs`."""
    here = Path(module_file).resolve()
    inputs_path, outputs_path = tmp_path / "inputs.pt", tmp_path / "outputs.pt"
    torch.save(inputs, inputs_path)
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent), str(TESTS), env.get("PYTHONPATH", "")])
    code = f"import sys, {here.stem} as t; t.run_interpreted(sys.argv[1], sys.argv[2])"
    done = subprocess.run(
        [sys.executable, "-c", code, str(inputs_path), str(outputs_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(outputs_path, weights_only=False)
