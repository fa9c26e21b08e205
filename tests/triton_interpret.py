"""TEST-ONLY: run a test module's Triton launches in Triton's interpreter, in a subprocess.

Whether a Triton kernel is interpreted is fixed when it is defined (`triton.jit` reads
TRITON_INTERPRET at import), and a pytest process may hold compiled ones (the GPU tests), so
interpreted launches run in another interpreter: the test pickles its inputs, the subprocess
imports the test module and calls its `run_interpreted(inputs, outputs)`, which writes the
results back.

The subprocess is started once per pytest process and serves every launch after (importing
torch, triton and the engine costs seconds of CPU each time; the launches themselves share
nothing but the modules): one JSON line per call on its stdin, one JSON reply line on a pipe
of its own. A call that fails gets the subprocess's traceback; one that runs past its timeout
kills the subprocess (the next call starts another).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

TESTS = Path(__file__).resolve().parent


class _Interpreter:
    """One long-lived `TRITON_INTERPRET=1` Python serving `run_interpreted` calls."""

    def __init__(self) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1")
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (as long-lived as the subprocess)
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import triton_interpret; triton_interpret._serve()"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )

    def call(self, module_file: Path, inputs: Path, outputs: Path, timeout_s: float) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        request = {"module": str(module_file), "inputs": str(inputs), "outputs": str(outputs)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise AssertionError(
                f"the interpreter subprocess gave no reply within {timeout_s:.0f}s "
                f"(exit {self.process.returncode}):\n{self._stderr_tail()}"
            )
        reply = json.loads(line)
        assert reply["ok"], reply["error"][-4000:]

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait()

    def _stderr_tail(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]


_interpreter: _Interpreter | None = None


def _shared() -> _Interpreter:
    global _interpreter
    if _interpreter is None or not _interpreter.alive():
        _interpreter = _Interpreter()
        atexit.register(_interpreter.close)
    return _interpreter


def interpret(module_file: str, inputs: Any, tmp_path: Path, timeout_s: float = 240) -> Any:
    """What `run_interpreted` of the test module at `module_file` writes for `inputs`."""
    inputs_path, outputs_path = tmp_path / "inputs.pt", tmp_path / "outputs.pt"
    torch.save(inputs, inputs_path)
    _shared().call(Path(module_file).resolve(), inputs_path, outputs_path, timeout_s)
    return torch.load(outputs_path, weights_only=False)


def _serve() -> None:
    """The subprocess's loop: a request per stdin line, a reply per line on the original
    stdout (what the modules print goes to stderr)."""
    import importlib
    import traceback

    assert os.environ.get("TRITON_INTERPRET") == "1"
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        request = json.loads(line)
        module_file = Path(request["module"])
        try:
            if str(module_file.parent) not in sys.path:
                sys.path.insert(0, str(module_file.parent))
            module = importlib.import_module(module_file.stem)
            module.run_interpreted(request["inputs"], request["outputs"])
            reply = {"ok": True, "error": ""}
        except BaseException:
            reply = {"ok": False, "error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
