"""The shared harness of the suites: the one table printer (Markdown and plain text, exactly),
the A/B rounds' rotating order, and the per-arm summary against a baseline (percentiles,
differences, ratio and the paired p50 over the rounds both arms sent in)."""

from __future__ import annotations

import asyncio
import math

import pytest

from benchmarks.harness.ab import Sample, closed_rounds, open_loop, rotation, summarize
from benchmarks.harness.steps import StepLog
from benchmarks.harness.table import Table


def sample(arm: str, round_: int, ttft_ms: float, tpot_ms: float = 1.0) -> Sample:
    return Sample(arm, round_, ttft_ms, tpot_ms, ttft_ms + 10.0, 4)


def test_markdown_table_exactly() -> None:
    table = Table.of(("router", "TTFT p50", "p90"), [("plain", "10.00", "12.50"),
                                                     ("auth+tls", "11.25", "13.00")])  # fmt: skip
    assert table.markdown() == (
        "| router | TTFT p50 | p90 |\n"
        "|---|---:|---:|\n"
        "| plain | 10.00 | 12.50 |\n"
        "| auth+tls | 11.25 | 13.00 |"
    )


def test_plain_table_pads_columns_by_alignment_without_trailing_spaces() -> None:
    rows = [("decode B=1", "1.5 ms", ""), ("prefill", "12.25 ms", "x")]
    table = Table.of(("what", "measured", "note"), rows, "lrl")
    assert table.plain() == (
        "what        measured  note\ndecode B=1    1.5 ms\nprefill     12.25 ms  x"
    )
    assert table.render(markdown=False) == table.plain()
    assert table.render() == table.markdown()


def test_a_table_refuses_ragged_rows_and_bad_alignment() -> None:
    with pytest.raises(ValueError, match="a row of 1 cells under a header of 2"):
        Table.of(("a", "b"), [("1",)])
    with pytest.raises(ValueError, match="align 'lx'"):
        Table.of(("a", "b"), [("1", "2")], "lx")


def test_the_step_log_table_exactly() -> None:
    log = StepLog()
    log.add("HBM copy bandwidth (read+write)", "4321 GB/s", "decode floors")
    log.add("decode B=64 ctx 2048 graphs fused", "12.34 ms", "floor 10.00 ms", "1.23x")
    assert log.table().plain() == (
        "what                                measured       reference  ratio\n"
        "HBM copy bandwidth (read+write)    4321 GB/s   decode floors\n"
        "decode B=64 ctx 2048 graphs fused   12.34 ms  floor 10.00 ms  1.23x"
    )


def test_a_failed_step_returns_none_and_adds_a_failed_row(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = StepLog(hint=lambda e: f"it was {type(e).__name__}")

    def boom() -> int:
        raise RuntimeError("no GPU")

    assert log.step("measure", boom) is None
    assert log.step("count", lambda: 3) == 3
    out = capsys.readouterr().out
    assert "== measure" in out and "!! measure FAILED after" in out
    assert "   hint: it was RuntimeError" in out
    assert [(r.what, r.measured) for r in log.rows] == [("measure", "FAILED")]


def test_rotation_takes_turns_first() -> None:
    arms = ("plain", "auth", "tls", "auth+tls")
    assert rotation(arms, 0) == ["plain", "auth", "tls", "auth+tls"]
    assert rotation(arms, 1) == ["auth", "tls", "auth+tls", "plain"]
    assert rotation(arms, 5) == rotation(arms, 1)
    assert [rotation(("off", "on"), r) for r in range(3)] == [
        ["off", "on"], ["on", "off"], ["off", "on"],
    ]  # fmt: skip


def test_summary_against_the_baseline_exactly() -> None:
    samples = [
        sample("off", 0, 10.0), sample("on", 0, 11.0),
        sample("on", 1, 12.0), sample("off", 1, 10.0),
        sample("off", 2, 20.0), sample("on", 2, 20.5),
    ]  # fmt: skip
    got = summarize(samples, ("off", "on"), "off")
    assert list(got) == ["off", "on"]
    off, on = got["off"], got["on"]
    assert (off.n, off.p50, off.minus_base_p50, off.ratio_p50, off.paired_p50) == (
        3, 10.0, 0.0, 1.0, 0.0,
    )  # fmt: skip
    assert (on.n, on.p50, on.p90, on.minus_base_p50) == (3, 12.0, pytest.approx(18.8), 2.0)
    assert on.ratio_p50 == pytest.approx(1.2)
    assert on.paired_p50 == 1.0  # rounds: +1.0, +2.0, +0.5
    assert on.minus_base_p99 == pytest.approx(20.33 - 19.8)  # p99s: 20.33 and 19.8
    e2e = summarize(samples, ("off", "on"), "off", "e2e_ms")["on"]
    assert (e2e.p50, e2e.paired_p50) == (22.0, 1.0)


def test_summary_pairs_only_rounds_both_arms_sent_in() -> None:
    samples = [sample("grpc", 0, 5.0), sample("http", 0, 6.0), sample("http", 1, 9.0)]
    http = summarize(samples, ("grpc", "http"), "grpc")["http"]
    assert http.paired_p50 == 1.0
    lone = summarize([sample("a", 0, 0.0)], ("a",), "a", "ttft_ms")["a"]
    assert math.isnan(lone.ratio_p50)


def test_closed_rounds_send_each_arm_once_a_round_in_rotating_order() -> None:
    sent: list[tuple[str, int, int]] = []
    before: list[str] = []

    async def send(arm: str, round_: int, prompt: list[int]) -> Sample:
        sent.append((arm, round_, len(prompt)))
        return sample(arm, round_, 1.0)

    async def mark(arm: str) -> None:
        before.append(arm)

    samples = asyncio.run(
        closed_rounds(("a", "b", "c"), send, 3, 7, seed=0, first_round=-3, before=mark)
    )
    assert [(a, r) for a, r, _ in sent] == [
        ("a", -3), ("b", -3), ("c", -3), ("b", -2), ("c", -2), ("a", -2),
        ("c", -1), ("a", -1), ("b", -1),
    ]  # fmt: skip
    assert {n for _, _, n in sent} == {7}
    assert before == [a for a, _, _ in sent]
    assert len(samples) == 9


def test_open_loop_interleaves_the_arms_by_rounds() -> None:
    async def send(arm: str, round_: int, prompt: list[int]) -> Sample:
        return sample(arm, round_, 1.0)

    samples = asyncio.run(open_loop(("direct", "grpc"), send, 5, rate=1e6, prompt_tokens=3, seed=1))
    assert [(s.arm, s.round) for s in samples] == [
        ("direct", 0), ("grpc", 0), ("grpc", 1), ("direct", 1), ("direct", 2),
    ]  # fmt: skip
