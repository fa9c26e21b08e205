"""`pdserve plan`: the cheapest clusters that meet a TTFT/TPOT SLO, searched in simulated time
(simulator/cluster.py over measured profiles, planner/perf_profile.py).

The search is given one profile per TP size of one worker (same model, dtype, card and block
size: `profiles_by_tp`). A configuration is a count of prefill and decode workers (xPyD), of
colocated workers (zC) or, when asked (`split`), of split workers (zS: prefill and decode
loops in SM partitions of one GPU, simulator/split.py, at its default parameters); each role
at each TP size given, independently (prefill workers of TP a, decode workers of TP b, each
stepping on its TP size's profile; labelled `1P(TP2)2D`, TP 1 unmarked), so a configuration
spends x * a + y * b GPUs (colocated: z * b; a split worker runs on one GPU, TP 1 only). A
hand-off between unequal TP sizes costs what the decode profile's hand-off model says
(simulator/cluster.py). Each configuration comes with a prefill chunk (`chunks`: each size
asked for is a configuration of its own, labelled `c<tokens>`; default the profile's budget
alone: a smaller chunk holds a colocated worker's TPOT down at the cost of its TTFT). Two
questions:

- `plan_for_rate` (`--rate R`): for 1, 2, ... `max_gpus` GPUs, every configuration of that
  many (1P(g-1)D ... (g-1)P1D at every pair of TP sizes, gC, and gS when asked) is
  simulated at R req/s; the first GPU
  count at which one meets the SLO (at least `attainment` of its requests meet every SLO) is
  the answer, its configurations ranked by goodput per GPU. None up to `max_gpus`: the
  closest (highest attainment at `max_gpus`) and by how much it misses.
- `plan_for_gpus` (`--gpus N`): every split of N GPUs is swept over `rates`; its answer is
  the highest rate it serves meeting the SLO (`loadtests.goodput.max_rate_meeting`: rates
  scanned upward, the first that fails ends the scan), ranked by goodput per GPU. The
  sweep's points give the Pareto plot: output tokens/s per GPU against tokens/s per user
  (1000 / TPOT p50).

What it does not search (docs/operations.md "Planning a cluster"): mixes of TP sizes within
one role, pipeline parallelism, mixes of split and other workers, a split's parameters, PD
pairs sharing a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from admission.config import AdmissionThresholds
from loadtests.goodput import SLO, GoodputReport
from planner.perf_profile import PerfProfile, PerfProfileError, check_same_worker
from simulator.report import simulate
from simulator.shape import DEFAULT_THRESHOLDS, ClusterShape
from simulator.shards import largest_shards

MIN_SHARD_WORKERS = 4
"""The fewest workers of each role a shard of a planned configuration keeps (`--shards`):
shards of 4P4D (128P128D at 1,000 req/s) and 4P4D (32P32D at 480) agreed with the whole
simulation within 5.1 %; shards of one or two prefill workers near their capacity queued far
more than the whole pool ("Simulator", speed at scale, in docs/benchmarks.md)."""


def profiles_by_tp(profiles: Sequence[PerfProfile]) -> dict[int, PerfProfile]:
    """TP size → its profile; refuses (PerfProfileError, naming the field) profiles of
    different models, dtypes, cards or block sizes, and two of one TP size."""
    if not profiles:
        raise PerfProfileError("--profile: give at least one")
    check_same_worker(profiles[0], *profiles[1:])
    out: dict[int, PerfProfile] = {}
    for p in profiles:
        tp = p.header.tensor_parallel_size
        if tp in out:
            raise PerfProfileError(f"--profile: two profiles of TP {tp} (one per TP size)")
        out[tp] = p
    return dict(sorted(out.items()))


def shapes_of(
    gpus: int,
    thresholds: AdmissionThresholds,
    chunks: Sequence[int] = (0,),
    split: bool = False,
    tp_sizes: Sequence[int] = (1,),
) -> list[ClusterShape]:
    """Every configuration of exactly `gpus` GPUs: xPyD with x, y >= 1 for every prefill TP
    a and decode TP b of `tp_sizes` (x * a + y * b GPUs), then zC at each TP, then gS when
    `split` (TP 1 only); each with every prefill chunk of `chunks` (0: the profile's)."""
    counts = []
    for a in tp_sizes:
        for b in tp_sizes:
            rest = [(p, gpus - p * a) for p in range(1, gpus)]
            counts += [(p, r // b, 0, 0, a, b) for p, r in rest if r >= b and r % b == 0]
    counts += [(0, 0, gpus // b, 0, b, b) for b in tp_sizes if gpus % b == 0]
    counts += [(0, 0, 0, gpus, 1, 1)] if split and 1 in tp_sizes else []
    return [
        ClusterShape(
            p, d, c, s, thresholds=thresholds, chunk_tokens=chunk, prefill_tp=a, decode_tp=b
        )
        for p, d, c, s, a, b in counts
        for chunk in chunks
    ]


def label(shape: ClusterShape) -> str:
    """`1P1D`, `2C`, `1S`, `1P2D+1C`, with `(TP<n>)` after a role of n > 1 ranks per worker
    (`1P(TP2)2D`, `2C(TP2)`), ` shared` for PD pairs on one GPU each and ` c<tokens>` for a
    chunk of its own."""

    def tp(n: int) -> str:
        return f"(TP{n})" if n > 1 else ""

    parts = []
    if shape.prefill or shape.decode:
        parts.append(f"{shape.prefill}P{tp(shape.prefill_tp)}{shape.decode}D{tp(shape.decode_tp)}")
    parts += [f"{shape.colocated}C{tp(shape.decode_tp)}"] if shape.colocated else []
    parts += [f"{shape.split}S"] if shape.split else []
    name = "+".join(parts) + (" shared" if shape.shared_device else "")
    return name + (f" c{shape.chunk_tokens}" if shape.chunk_tokens else "")


def gpus_of(shape: ClusterShape) -> int:
    """GPUs the configuration holds: every worker's ranks (a shared pair counted once)."""
    pairs = shape.prefill if shape.shared_device else 0
    decoding = shape.decode + shape.colocated + shape.split
    return (shape.prefill - pairs) * shape.prefill_tp + decoding * shape.decode_tp


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
    profiles: PerfProfile | Mapping[int, PerfProfile],
    workload: str,
    duration_s: float,
    slo: SLO,
    seed: int,
    shards: int = 1,
) -> Simulate:
    """(shape, rate) → the simulated run's report: the same workload and seed every time,
    each role on its TP size's profile (`profiles`: TP size → profile, `profiles_by_tp`; or
    one profile). `shards` > 1: each configuration is simulated as the most shards up to
    `shards` that divide its role counts and keep `MIN_SHARD_WORKERS` of each role a shard
    (simulator/shards.py: an approximation; smaller configurations whole)."""
    by_tp = (
        {profiles.header.tensor_parallel_size: profiles}
        if isinstance(profiles, PerfProfile)
        else dict(profiles)
    )

    def run(shape: ClusterShape, rate: float) -> GoodputReport:
        decode, prefill = by_tp[shape.decode_tp], by_tp[shape.prefill_tp]
        return simulate(
            decode, shape, workload, rate, duration_s, slo, seed,
            prefill_profile=prefill if prefill is not decode else None, keep_records=False,
            shards=largest_shards(shape, shards, MIN_SHARD_WORKERS),
        ).report  # fmt: skip

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
    tp_sizes: Sequence[int] = (1,),
) -> Plan:
    """The fewest GPUs that serve `rate` within the SLO (module docstring), every role at
    every TP size of `tp_sizes`."""
    if rate <= 0:
        raise ValueError(f"--rate: must be > 0, got {rate}")
    if max_gpus < 1:
        raise ValueError(f"--max-gpus: must be >= 1, got {max_gpus}")
    points: list[Point] = []
    for gpus in range(1, max_gpus + 1):
        shapes = shapes_of(gpus, thresholds or DEFAULT_THRESHOLDS, chunks, split, tp_sizes)
        here = [Point(s, rate, run(s, rate)) for s in shapes]
        points += here
        meeting = [p for p in here if p.meets(attainment)]
        if meeting:
            return Plan(slo, attainment, ranked(meeting), tuple(points), {})
    largest = max((p.gpus for p in points), default=0)  # max_gpus, unless no shape spends it
    at_most = [p for p in points if p.gpus == largest]
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
    tp_sizes: Sequence[int] = (1,),
) -> Plan:
    """Every configuration of `gpus` GPUs (each role at every TP size of `tp_sizes`), swept
    over `rates` (module docstring)."""
    if gpus < 1:
        raise ValueError(f"--gpus: must be >= 1, got {gpus}")
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--rate: rates must be > 0, got {list(rates)}")
    points: list[Point] = []
    best: list[Point] = []
    max_rate: dict[str, float | None] = {}
    for shape in shapes_of(gpus, thresholds or DEFAULT_THRESHOLDS, chunks, split, tp_sizes):
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
