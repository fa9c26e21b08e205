"""PNG figures a person can read: TTFT/TPOT CDFs per offered rate, and goodput vs offered rate.

Matplotlib's object API with the Agg canvas (no pyplot, no display, no global state).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loadtests.goodput import SLO, GoodputReport, by_rate, goodput_curve, max_rate_meeting
from loadtests.records import RequestRecord


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    n = len(xs)
    return [xs[0], *xs], [0.0] + [100.0 * (i + 1) / n for i in range(n)]


def plot_latency_cdfs(
    runs: Sequence[tuple[str, Sequence[RequestRecord]]], slo: SLO, path: Path
) -> Path:
    """TTFT and TPOT CDFs side by side, one line per run (label, records), SLOs dashed."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_ttft, ax_tpot = fig.subplots(1, 2)
    panels = (
        (ax_ttft, "TTFT", "ttft_ms", slo.ttft_ms),
        (ax_tpot, "TPOT (mean time per output token after the first)", "tpot_ms", slo.tpot_ms),
    )
    for ax, title, attr, limit in panels:
        for label, records in runs:
            values = [getattr(r, attr) for r in records if r.ok and getattr(r, attr) is not None]
            if values:
                xs, ys = _cdf(values)
                ax.step(xs, ys, where="post", label=f"{label} (n={len(values)})")
        if limit is not None:
            ax.axvline(limit, color="black", linestyle="--", linewidth=1, label=f"SLO {limit:g} ms")
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("% of successful requests at or below")
        ax.set_ylim(0, 100.5)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="lower right")
    fig.savefig(path, dpi=110)
    return path


def plot_goodput_sweep(
    reports: Sequence[GoodputReport], path: Path, attainment_target: float = 0.9
) -> Path:
    """Left: goodput and throughput vs offered rate (ideal y = x). Right: SLO attainment."""
    from matplotlib.figure import Figure

    pairs = by_rate(reports)
    rates = [rate for rate, _ in pairs]
    rated = [report for _, report in pairs]
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_rate, ax_att = fig.subplots(1, 2)
    slo = rated[0].slo.describe() if rated else ""
    if rates:
        top = max(rates)
        ax_rate.plot([0, top], [0, top], color="grey", linestyle=":", label="offered (ideal)")
        ax_rate.plot(rates, [r.throughput_rps for r in rated], marker="s", label="completed")
        ax_rate.plot(rates, [r.goodput_rps for r in rated], marker="o", label=f"goodput ({slo})")
        ax_att.plot(rates, [100 * r.attainment for r in rated], marker="o", label="met all SLOs")
    ax_att.axhline(
        100 * attainment_target, color="black", linestyle="--", linewidth=1, label="target"
    )
    best = max_rate_meeting(rated, attainment_target)
    if best is not None:
        ax_att.axvline(
            best, color="green", linestyle="--", linewidth=1, label=f"max {best:g} req/s"
        )
    ax_rate.set_title("Goodput vs offered rate")
    ax_rate.set_xlabel("offered rate (req/s)")
    ax_rate.set_ylabel("req/s")
    ax_att.set_title(f"SLO attainment ({slo})")
    ax_att.set_xlabel("offered rate (req/s)")
    ax_att.set_ylabel("% of requests")
    ax_att.set_ylim(0, 102)
    for ax in (ax_rate, ax_att):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path


def plot_goodput_against_tpot_slo(
    series: Sequence[tuple[str, Sequence[tuple[float, Sequence[RequestRecord]]]]],
    ttft_ms: float,
    tpot_slos_ms: Sequence[float],
    path: Path,
    title: str,
    attainment: float = 0.9,
) -> Path:
    """Goodput (the highest swept rate at which `attainment` of requests meet TTFT <=
    `ttft_ms` and the TPOT SLO) against the TPOT SLO, one line per series (label, [(rate,
    records)]). A point at a series' highest swept rate is hollow: the rate that breaks it was
    not reached; where even the lowest rate swept fails, there is no point."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.subplots()
    for label, runs in series:
        top = max(rate for rate, _ in runs)
        curve = goodput_curve(runs, ttft_ms, tpot_slos_ms, attainment)
        points = [(t, g) for t, g in zip(tpot_slos_ms, curve, strict=True) if g is not None]
        xs, ys = [t for t, _ in points], [g for _, g in points]
        open_xs = [t for t, g in points if g == top]
        open_ys = [top] * len(open_xs)
        (line,) = ax.plot(xs, ys, marker="o", label=label)
        ax.plot(open_xs, open_ys, linestyle="", marker="o", markersize=9,
                markerfacecolor="white", color=line.get_color())  # fmt: skip
    ax.set_title(title)
    ax.set_xlabel(f"TPOT SLO (ms); TTFT SLO {ttft_ms:g} ms, {attainment:.0%} of requests")
    ax.set_ylabel("goodput (req/s; hollow: highest rate swept)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path
