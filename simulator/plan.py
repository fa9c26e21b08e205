"""`pdserve plan`: the cheapest clusters that meet a TTFT/TPOT SLO, searched in simulated time
(simulator/cluster.py over a measured profile, planner/perf_profile.py).

A configuration is a count of prefill and decode workers (xPyD), of colocated workers (zC)
or, when asked (`split`), of split workers (zS: prefill and decode loops in SM partitions of
one GPU, simulator/split.py, at its default parameters), one GPU each (TP 1: the profile's),
with a prefill chunk (`chunks`: each size asked for
is a configuration of its own, labelled `c<tokens>`; default the profile's budget alone: a
smaller chunk holds a colocated worker's TPOT down at the cost of its TTFT). Two questions:

- `plan_for_rate` (`--rate R`): for 1, 2, ... `max_gpus` GPUs, every split of that many
  (1P(g-1)D ... (g-1)P1D, gC, and gS when asked) is simulated at R req/s; the first GPU
  count at which one meets the SLO (at least `attainment` of its requests meet every SLO) is
  the answer, its configurations ranked by goodput per GPU. None up to `max_gpus`: the
  closest (highest attainment at `max_gpus`) and by how much it misses.
- `plan_for_gpus` (`--gpus N`): every split of N GPUs is swept over `rates`; its answer is
  the highest rate it serves meeting the SLO (`loadtests.goodput.max_rate_meeting`: rates
  scanned upward, the first that fails ends the scan), ranked by goodput per GPU. The
  sweep's points give the Pareto plot: output tokens/s per GPU against tokens/s per user
  (1000 / TPOT p50).

What it does not search (docs/operations.md "Planning a cluster"): TP per role (one profile
per search), mixes of split and other workers, a split's parameters, PD pairs sharing a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from admission.config import AdmissionThresholds
from loadtests.goodput import SLO, GoodputReport
from planner.perf_profile import PerfProfile
from simulator.cluster import DEFAULT_THRESHOLDS, ClusterShape
from simulator.report import simulate


def shapes_of(
    gpus: int, thresholds: AdmissionThresholds, chunks: Sequence[int] = (0,), split: bool = False
) -> list[ClusterShape]:
    """Every configuration of `gpus` one-GPU workers: xPyD with x, y >= 1, then gC, then gS
    when `split`; each with every prefill chunk of `chunks` (0: the profile's)."""
    counts = [(p, gpus - p, 0, 0) for p in range(1, gpus)] + [(0, 0, gpus, 0)]
    counts += [(0, 0, 0, gpus)] if split else []
    return [
        ClusterShape(p, d, c, s, thresholds=thresholds, chunk_tokens=chunk)
        for p, d, c, s in counts
        for chunk in chunks
    ]


def label(shape: ClusterShape) -> str:
    """`1P1D`, `2C`, `1S`, `1P2D+1C`, with ` shared` for PD pairs on one GPU each and
    ` c<tokens>` for a chunk of its own."""
    parts = [f"{shape.prefill}P{shape.decode}D"] if shape.prefill or shape.decode else []
    parts += [f"{shape.colocated}C"] if shape.colocated else []
    parts += [f"{shape.split}S"] if shape.split else []
    name = "+".join(parts) + (" shared" if shape.shared_device else "")
    return name + (f" c{shape.chunk_tokens}" if shape.chunk_tokens else "")


def gpus_of(shape: ClusterShape) -> int:
    pairs = shape.prefill if shape.shared_device else 0
    return shape.prefill + shape.decode + shape.colocated + shape.split - pairs


@dataclass(frozen=True)
class Point:
    """One configuration simulated at one rate."""

    shape: ClusterShape
    rate: float
    report: GoodputReport

    @property
    def gpus(self) -> int:
        return gpus_of(self.shape)

    @property
    def goodput_per_gpu(self) -> float:
        return self.report.goodput_rps / self.gpus

    @property
    def tokens_per_gpu(self) -> float:
        return self.report.output_tokens_per_s / self.gpus

    @property
    def tokens_per_user(self) -> float:
        """Decode speed one stream sees, tokens/s (1000 / TPOT p50; 0 without a TPOT)."""
        tpot = self.report.tpot.p50
        return 1000.0 / tpot if tpot > 0 and not math.isnan(tpot) else 0.0

    def meets(self, attainment: float) -> bool:
        return self.report.attainment + 1e-12 >= attainment


@dataclass(frozen=True)
class Plan:
    """What a search found: `chosen` (meeting, best first; empty: none met) and every point
    it simulated (`closest` says by how much the best of them misses)."""

    slo: SLO
    attainment: float
    chosen: tuple[Point, ...]
    points: tuple[Point, ...]
    max_rate: dict[str, float | None]
    """`plan_for_gpus`: each configuration's highest rate meeting the SLO (None: not even the
    lowest); empty for `plan_for_rate`."""

    @property
    def closest(self) -> Point | None:
        """The point nearest to meeting: highest attainment, then most GPUs (a larger
        cluster is the one to grow)."""
        if not self.points:
            return None
        return max(self.points, key=lambda p: (p.report.attainment, p.gpus, -p.rate))

    def misses(self, point: Point) -> list[str]:
        """How `point` misses the SLO, one phrase per target (p90 against the target)."""
        out = [f"attainment {point.report.attainment:.0%} < {self.attainment:.0%}"]
        for name, target, stats in (
            ("TTFT", self.slo.ttft_ms, point.report.ttft),
            ("TPOT", self.slo.tpot_ms, point.report.tpot),
            ("E2E", self.slo.e2e_ms, point.report.e2e),
        ):
            if target is not None and stats.p90 > target:
                out.append(f"{name} p90 {stats.p90:.0f} ms > {target:g} ms "
                           f"(+{100 * (stats.p90 / target - 1):.0f}%)")  # fmt: skip
        if point.report.failed:
            out.append(f"{point.report.failed} of {point.report.requests} refused or failed")
        return out


Simulate = Callable[[ClusterShape, float], GoodputReport]


def simulator_for(
    profile: PerfProfile, workload: str, duration_s: float, slo: SLO, seed: int
) -> Simulate:
    """(shape, rate) → the simulated run's report: the same workload and seed every time."""

    def run(shape: ClusterShape, rate: float) -> GoodputReport:
        return simulate(profile, shape, workload, rate, duration_s, slo, seed).report

    return run


def ranked(points: Sequence[Point]) -> tuple[Point, ...]:
    return tuple(sorted(points, key=lambda p: (-p.goodput_per_gpu, p.gpus, label(p.shape))))


def plan_for_rate(
    run: Simulate,
    rate: float,
    slo: SLO,
    *,
    max_gpus: int,
    attainment: float = 0.9,
    thresholds: AdmissionThresholds | None = None,
    chunks: Sequence[int] = (0,),
    split: bool = False,
) -> Plan:
    """The fewest GPUs that serve `rate` within the SLO (module docstring)."""
    if rate <= 0:
        raise ValueError(f"--rate: must be > 0, got {rate}")
    if max_gpus < 1:
        raise ValueError(f"--max-gpus: must be >= 1, got {max_gpus}")
    points: list[Point] = []
    for gpus in range(1, max_gpus + 1):
        shapes = shapes_of(gpus, thresholds or DEFAULT_THRESHOLDS, chunks, split)
        here = [Point(s, rate, run(s, rate)) for s in shapes]
        points += here
        meeting = [p for p in here if p.meets(attainment)]
        if meeting:
            return Plan(slo, attainment, ranked(meeting), tuple(points), {})
    at_most = [p for p in points if p.gpus == max_gpus]
    return Plan(slo, attainment, (), tuple(at_most), {})


def plan_for_gpus(
    run: Simulate,
    gpus: int,
    rates: Sequence[float],
    slo: SLO,
    *,
    attainment: float = 0.9,
    thresholds: AdmissionThresholds | None = None,
    chunks: Sequence[int] = (0,),
    split: bool = False,
) -> Plan:
    """Every configuration of `gpus` GPUs, swept over `rates` (module docstring)."""
    if gpus < 1:
        raise ValueError(f"--gpus: must be >= 1, got {gpus}")
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--rate: rates must be > 0, got {list(rates)}")
    points: list[Point] = []
    best: list[Point] = []
    max_rate: dict[str, float | None] = {}
    for shape in shapes_of(gpus, thresholds or DEFAULT_THRESHOLDS, chunks, split):
        top: Point | None = None
        for rate in sorted(rates):
            point = Point(shape, rate, run(shape, rate))
            points.append(point)
            if not point.meets(attainment):
                break  # as max_rate_meeting: the first failing rate ends the scan
            top = point
        max_rate[label(shape)] = None if top is None else top.rate
        if top is not None:
            best.append(top)
    return Plan(slo, attainment, ranked(best), tuple(points), max_rate)


def geometric_rates(low: float, high: float, count: int) -> list[float]:
    """`count` rates from `low` to `high`, evenly spaced on a log scale (2 significant
    figures)."""
    if not 0 < low <= high or count < 1:
        raise ValueError(f"rates: want 0 < low <= high and count >= 1, got {low}, {high}, {count}")
    if count == 1:
        return [low]
    step = (high / low) ** (1 / (count - 1))
    return sorted({float(f"{low * step**i:.2g}") for i in range(count)})


def pareto(points: Sequence[Point]) -> list[Point]:
    """The points no other beats on both tokens/s per GPU and tokens/s per user."""
    front = []
    for p in points:
        if not any(
            q.tokens_per_gpu >= p.tokens_per_gpu and q.tokens_per_user >= p.tokens_per_user
            and (q.tokens_per_gpu, q.tokens_per_user) != (p.tokens_per_gpu, p.tokens_per_user)
            for q in points
        ):  # fmt: skip
            front.append(p)
    return sorted(front, key=lambda p: p.tokens_per_user)
