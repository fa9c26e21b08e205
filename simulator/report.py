"""A simulated run as the load driver would have recorded it: one `RequestRecord` per request
(loadtests/records.py), summarized and printed by the same code as `pdserve bench`
(loadtests/goodput.py:summarize, loadtests/bench.py:summary_tables)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from loadtests.bench import BenchSummary, RateResult
from loadtests.goodput import SLO, GoodputReport, summarize
from loadtests.records import OK, RequestRecord, StreamTimer
from loadtests.workload import PlannedRequest, load_profile, stream
from planner.perf_profile import PerfProfile
from router.placement import PrefillReason
from simulator.cluster import Simulation
from simulator.columns import RecordColumns
from simulator.shape import ClusterShape
from simulator.shards import first_shard, scale_report, shard_shape
from simulator.workers import SimRequest, SimWorker


@dataclass(frozen=True)
class WorkerUse:
    worker_id: str
    role: str
    busy_fraction: float
    """Share of the run the worker spent in steps."""
    kv_overflows: int


@dataclass(frozen=True)
class SimResult:
    records: tuple[RequestRecord, ...]
    report: GoodputReport
    workers: tuple[WorkerUse, ...]
    placements: tuple[tuple[PrefillReason, int], ...] = ()
    """Placed requests by why they were prefilled where they were, most first."""

    def placement_line(self) -> str:
        """`local N (reason n, ...), remote M (...)`: where prompts were prefilled and why."""
        parts = []
        for site in ("local", "remote"):
            mine = [(why, n) for why, n in self.placements if (site == "local") == why.local]
            detail = ", ".join(f"{why.value} {n}" for why, n in mine)
            parts.append(f"{site} {sum(n for _, n in mine)}" + (f" ({detail})" if detail else ""))
        return ", ".join(parts)


def to_record(r: SimRequest, rate: float | None) -> RequestRecord:
    p = r.planned
    if r.status != OK or not r.tokens:
        return RequestRecord(
            p.request_id, p.index, r.sent_s, p.send_at_s, p.prompt_tokens, p.max_tokens, 0,
            (r.done_s - r.sent_s) * 1000.0, status=r.status, offered_rate=rate,
            conversation=p.conversation, turn=p.turn,
        )  # fmt: skip
    # the load driver's own arithmetic over the first and last token (all TTFT, TPOT and E2E
    # read); the gaps between are the run's (`Simulation.gaps`), not the record's
    times = [r.first_token_s] if r.tokens == 1 else [r.first_token_s, r.last_token_s]
    timer = StreamTimer(r.sent_s, times, r.tokens)
    return RequestRecord(
        request_id=p.request_id,
        index=p.index,
        sent_s=r.sent_s,
        scheduled_s=p.send_at_s,
        prompt_tokens=p.prompt_tokens,
        max_tokens=p.max_tokens,
        output_tokens=timer.output_tokens,
        e2e_ms=timer.e2e_ms(r.last_token_s),
        ttft_ms=timer.ttft_ms,
        tpot_ms=timer.tpot_ms,
        cached_prompt_tokens=r.cached_tokens,
        server_transfer_ms=r.handoff_s * 1000.0,
        offered_rate=rate,
        conversation=p.conversation,
        turn=p.turn,
    )


def simulate(
    profile: PerfProfile,
    shape: ClusterShape,
    workload: str | Path,
    rate: float,
    duration_s: float,
    slo: SLO,
    seed: int = 0,
    num_requests: int | None = None,
    prefill_profile: PerfProfile | None = None,
    keep_records: bool = True,
    shards: int = 1,
) -> SimResult:
    """`workload` (a load-driver profile) at `rate` req/s for `duration_s` through `shape`
    (prefill workers on `prefill_profile`, None: `profile`). The workload is made as the run
    pulls it and each request is summarized as it ends (`RecordColumns`); `keep_records`
    keeps its record too (`SimResult.records`; False: empty, and memory holds ~32 bytes a
    request: an hour at 1,000 req/s fits). `shards` > 1: one shard of the cluster serves its
    share of the workload and the report is scaled back (simulator/shards.py: an
    approximation; the records and workers are the shard's)."""
    one_shard = shard_shape(shape, shards)
    planned = stream(
        load_profile(workload),
        rate=rate,
        duration_s=duration_s,
        seed=seed,
        num_requests=num_requests,
        shard=first_shard(shards),
    )
    sim = Simulation(profile, one_shard, prefill_profile)
    result = run_summarized(sim, planned, slo, rate, keep_records)
    return replace(result, report=scale_report(result.report, shards))


def run_summarized(
    sim: Simulation,
    planned: Iterable[PlannedRequest],
    slo: SLO,
    rate: float | None,
    keep_records: bool = False,
) -> SimResult:
    """`sim` over `planned` (pulled as the run goes: `Simulation.run`), each request
    summarized as it ends (`RecordColumns`) and dropped, its record kept if `keep_records`."""
    columns = RecordColumns(slo, rate)
    kept: list[RequestRecord] = []
    placed: Counter[PrefillReason] = Counter()

    def ended(r: SimRequest) -> None:
        record = to_record(r, rate)
        columns.add(record)
        if keep_records:
            kept.append(record)
        if r.placement is not None:
            placed[r.placement] += 1

    sim.run(planned, on_end=ended)
    span = max(sim.now, 1e-9)
    return SimResult(
        tuple(sorted(kept, key=lambda record: record.index)),
        columns.report(sim.gaps.stats_ms()),
        tuple(_use(w, span) for w in sim.workers.values()),
        tuple(sorted(placed.items(), key=lambda kv: (-kv[1], kv[0].value))),
    )


def summary(
    records: Sequence[RequestRecord], slo: SLO, sim: Simulation, rate: float | None
) -> GoodputReport:
    """`summarize` over the run's records, its ITL over the run's gaps (a record carries no
    gaps: `simulator/gaps.py`)."""
    return replace(summarize(records, slo, offered_rate=rate), itl=sim.gaps.stats_ms())


def _use(w: SimWorker, span: float) -> WorkerUse:
    return WorkerUse(w.worker_id, w.role.value, min(1.0, w.busy_s / span), w.kv_overflows)


def as_bench_summary(
    target: str, workload: str, slo: SLO, duration_s: float, seed: int,
    results: Sequence[tuple[float, SimResult]],
) -> BenchSummary:  # fmt: skip
    """The simulated runs in the shape `pdserve bench` prints (no files written)."""
    from loadtests.goodput import max_rate_meeting

    rate_results = tuple(RateResult(rate, r.report, Path(), Path()) for rate, r in results)
    return BenchSummary(
        target=target,
        profile=workload,
        api="simulated",
        seed=seed,
        slo=slo,
        duration_s=duration_s,
        used_locust=False,
        results=rate_results,
        attainment_target=0.9,
        max_rate=max_rate_meeting([r.report for _, r in results], 0.9),
        out_dir=Path(),
        files=(),
    )
