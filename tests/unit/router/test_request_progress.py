"""`RequestProgress`: the usage and timings of the last delta and the router's per-request
record, computed from its events on a fake clock (exact values)."""

from __future__ import annotations

from typing import Any

import pytest

from router import progress as progress_module
from router.placement import Placement
from router.progress import RequestProgress, RequestRecord, StreamDelta, Timings, Usage
from vocabulary.decode_api import TokenChunk
from vocabulary.engine_io import FinishReason, PriorOutput
from vocabulary.prefill_api import PrefillResult

DISAGGREGATED = Placement("decode-1", "prefill-0", cached_blocks=1, uncached_tokens=22)
LOCAL = Placement("decode-1", None, cached_blocks=0, uncached_tokens=38)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", c)
    return c


def prefill_result(first_logprob: float | None = None) -> PrefillResult:
    return PrefillResult(
        "r", 7, "a", first_logprob, None, object(),  # type: ignore[arg-type]
        38, 16, 0.010, 0.250, "prefill-0",
    )  # fmt: skip


def chunk(*tokens: int, reason: FinishReason | None = None, **kw: Any) -> TokenChunk:
    return TokenChunk(tuple(tokens), "b" * len(tokens), None, reason, **kw)


def test_a_disaggregated_request_times_prefill_transfer_ttft_and_tpot(clock: Clock) -> None:
    p = RequestProgress(prompt_tokens=38)
    p.admitted(queued_ms=5.0)
    p.placed(DISAGGREGATED)
    clock.now = 100.3
    p.prefilled("prefill-0", prefill_result(-0.5))
    assert p.first_token_out(prefill_result(-0.5)) == StreamDelta((7,), "a", (-0.5,))
    assert p.last_token == (7, -0.5) and p.completion_tokens == 1 and p.decoded_tokens == 0
    assert p.sent_any and p.prior(with_last=True) == PriorOutput((7,), 1)
    clock.now = 100.5
    p.chunk(chunk(8, 9, transfer_s=0.04, num_transferred_tokens=22))
    clock.now = 100.7
    p.chunk(chunk(10, reason=FinishReason.LENGTH))
    assert (p.completion_tokens, p.decoded_tokens) == (4, 3)
    clock.now = 101.0
    final = p.final_delta(FinishReason.LENGTH)
    assert (final.token_ids, final.text, final.finish_reason) == ((), "", FinishReason.LENGTH)
    assert final.usage == Usage(38, 4, 16, 22)
    assert final.timings == Timings(
        queue_ms=5.0, prefill_ms=250.0, transfer_ms=pytest.approx(40.0),
        ttft_ms=pytest.approx(300.0), tpot_ms=pytest.approx(400.0 / 3), e2e_ms=1000.0,
        prefill_worker="prefill-0", decode_worker="decode-1", local_prefill=False,
    )  # fmt: skip
    assert p.record() == RequestRecord(
        ttft_s=pytest.approx(0.3), tpot_s=pytest.approx(0.4 / 3), e2e_s=1.0,
        first_token_worker="prefill-0", decode_worker="decode-1", cached_prompt_tokens=16,
        transferred_prompt_tokens=22, prefill_worker="prefill-0",
    )  # fmt: skip


def test_a_local_prefill_takes_its_stats_from_the_first_chunk_and_counts_no_decoded_tokens(
    clock: Clock,
) -> None:
    p = RequestProgress(prompt_tokens=38)
    p.placed(LOCAL)
    clock.now = 100.2
    p.chunk(chunk(7, prefill_s=0.15, num_cached_prompt_tokens=32))
    clock.now = 100.4
    p.chunk(chunk(8, prefill_s=9.0, num_cached_prompt_tokens=0))  # later chunks: not prefill
    # a local prefill's tokens are the client's too: a retry continues after both
    assert (p.completion_tokens, p.decoded_tokens, p.sent_any) == (2, 0, True)
    assert p.prior(with_last=False).token_ids == (7,) and p.last_token[0] == 8
    timings = p.final_delta(FinishReason.STOP).timings
    assert timings is not None and timings.local_prefill and timings.prefill_worker == ""
    assert timings.prefill_ms == pytest.approx(150.0) and timings.ttft_ms == pytest.approx(200.0)
    record = p.record()
    assert record.first_token_worker == "decode-1" and record.cached_prompt_tokens == 32


def test_a_resume_after_the_first_token_is_not_a_local_prefill(clock: Clock) -> None:
    p = RequestProgress(prompt_tokens=38)
    p.placed(DISAGGREGATED)
    p.prefilled("prefill-0", prefill_result())
    p.first_token_out(prefill_result())
    p.placed(LOCAL)  # no prefill worker left: the decode worker resumes
    p.chunk(chunk(8, 9, prefill_s=3.0))
    timings = p.final_delta(FinishReason.LENGTH).timings
    assert timings is not None and not timings.local_prefill and timings.prefill_ms == 250.0
    assert (p.completion_tokens, p.decoded_tokens) == (3, 2)


def test_a_request_that_sent_nothing_has_no_ttft_in_its_record(clock: Clock) -> None:
    p = RequestProgress(prompt_tokens=38)
    clock.now = 100.5
    assert p.record() == RequestRecord(None, None, 0.5, "", "", 0)
    timings = p.final_delta(FinishReason.ABORT).timings
    assert timings is not None and timings.ttft_ms == timings.e2e_ms == 500.0
    assert timings.tpot_ms == 0.0
