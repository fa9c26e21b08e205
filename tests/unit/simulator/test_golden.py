"""The simulator predicts what was recorded (data/golden.json): every request of the recorded
scenarios (tests/unit/simulator/golden.py) has the same status, placement, cached tokens, decode
worker and token times (TTFT, last token, token count, the sum of its token times; float
tolerance 1e-9 relative)."""

from __future__ import annotations

import json

import pytest
from golden import GOLDEN, SCENARIOS, run

RECORDED = json.loads(GOLDEN.read_text())
FLOATS = ("sent_s", "done_s", "handoff_s", "first_token_s", "last_token_s", "token_times_sum")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_request_has_its_recorded_outcome(name: str) -> None:
    want = RECORDED[name]
    got = run(name)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for key, value in w.items():
            if key in FLOATS and value is not None:
                assert g[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (name, g["index"], key)
            else:
                assert g[key] == value, (name, g["index"], key)
