"""TEST-ONLY: a step that raises once, for the engine loop's recovery tests."""

from __future__ import annotations

from typing import Any

import pytest


def fail_first_execute(
    monkeypatch: pytest.MonkeyPatch, runner: Any, message: str = "injected step failure"
) -> None:
    """Make `runner.execute` raise RuntimeError(`message`) on its first call only."""
    real_execute, calls = runner.execute, {"n": 0}

    def execute_failing_once(batch: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError(message)
        return real_execute(batch)

    monkeypatch.setattr(runner, "execute", execute_failing_once)
