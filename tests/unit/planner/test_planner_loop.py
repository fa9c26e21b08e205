"""The planner's shell: measurements -> TickInput, the actuator's calls, the autoscaler request
and the config mapping (no Ray: a fake controller host and a recording request function)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from planner.core import PlannerConfig, Role, RoleBounds
from planner.loop import (
    PlannerLoop,
    PlannerSettings,
    ResourceRequester,
    WorkerSnapshot,
    build_tick,
    resource_bundles,
    settings_from_dict,
)
from planner.replay import read_trace
from router.metrics import Arrivals, RecentSamples, TimedSample
from router.router_server import RouterSignals
from vocabulary.engine_io import EngineLoad
from vocabulary.transfer_load import TransferLoad
from vocabulary.worker_api import ActorPlacement, WorkerLoad, WorkerRole, WorkerState

NOW = 10_000.0


def make_load(
    worker_id: str,
    role: WorkerRole,
    *,
    inflight: int = 0,
    waiting: int = 0,
    running: int = 0,
    leases: int = 0,
    pulling: int = 0,
    queued_pulls: int = 0,
    prompt_tokens: int = 0,
) -> WorkerLoad:
    engine = EngineLoad(
        num_waiting=waiting,
        num_running=running,
        num_waiting_prefill_tokens=0,
        num_free_blocks=100,
        num_total_blocks=128,
        num_handoff_blocks=0,
        num_transfer_blocks=0,
        num_cache_query_tokens=prompt_tokens,
        num_cache_hit_tokens=0,
        num_preemptions=0,
    )
    return WorkerLoad(
        worker_id=worker_id,
        role=role,
        state=WorkerState.READY,
        engine=engine,
        inflight_requests=inflight,
        requests_done=0,
        transfer=TransferLoad(in_flight_transfers=pulling, queued_transfers=queued_pulls),
        leases_held=leases,
    )


def snap(
    worker_id: str,
    role: WorkerRole,
    *,
    ready_at: float | None = NOW - 100,
    draining: bool = False,
    **load: Any,
) -> WorkerSnapshot:
    planner_role = Role.PREFILL if role is WorkerRole.PREFILL else Role.DECODE
    return WorkerSnapshot(
        worker_id,
        planner_role,
        ready_at,
        draining,
        None if ready_at is None else make_load(worker_id, role, **load),
    )


def signals(
    ttft: Sequence[tuple[str, float]] = (),
    tpot: Sequence[tuple[str, float]] = (),
    queued: int = 0,
) -> RouterSignals:
    return RouterSignals(
        RecentSamples(
            tuple(TimedSample(w, NOW - 1, v) for w, v in ttft),
            tuple(TimedSample(w, NOW - 1, v) for w, v in tpot),
        ),
        queued_requests=queued,
        inflight_requests=0,
    )


# ---- build_tick ---------------------------------------------------------------------------


def test_build_tick_maps_loads_to_worker_views() -> None:
    tick = build_tick(
        3,
        NOW,
        [
            snap("prefill-1", WorkerRole.PREFILL, inflight=2, leases=1),
            snap("decode-2", WorkerRole.DECODE, inflight=4, pulling=1, queued_pulls=2),
            snap("decode-3", WorkerRole.DECODE, draining=True, ready_at=NOW - 5),
            snap("prefill-4", WorkerRole.PREFILL, ready_at=None),
        ],
        [],
    )
    assert tick.tick == 3 and tick.now_s == NOW
    assert [(w.worker_id, w.age_s, w.inflight_requests, w.inflight_transfers, w.draining)
            for w in tick.prefill_workers] == [
        ("prefill-1", 100.0, 2, 1, False),
        ("prefill-4", 0.0, 0, 0, False),  # starting: counts as active, warming up
    ]  # fmt: skip
    assert [(w.worker_id, w.age_s, w.inflight_requests, w.inflight_transfers, w.draining)
            for w in tick.decode_workers] == [
        ("decode-2", 100.0, 4, 3, False),
        ("decode-3", 5.0, 0, 0, True),
    ]  # fmt: skip


def test_queue_depth_is_router_queues_plus_prefill_waiting() -> None:
    tick = build_tick(
        0,
        NOW,
        [
            snap("prefill-0", WorkerRole.PREFILL, waiting=3),
            snap("decode-1", WorkerRole.DECODE, waiting=5),  # decode waits do not count
        ],
        [signals(queued=2), signals(queued=1)],
    )
    assert tick.queue_depth == 6


def test_colocated_queue_counts_decode_waiting() -> None:
    tick = build_tick(0, NOW, [snap("colocated-0", WorkerRole.COLOCATED, waiting=4)], [])
    assert tick.queue_depth == 4 and tick.prefill_workers == ()


def test_samples_from_all_routers_are_merged() -> None:
    tick = build_tick(
        0,
        NOW,
        [],
        [signals(ttft=[("prefill-0", 100.0)]), signals(ttft=[("prefill-1", 300.0)],
                                                       tpot=[("decode-2", 20.0)])],
    )  # fmt: skip
    assert sorted(s.value_ms for s in tick.ttft_samples) == [100.0, 300.0]
    assert [(s.worker_id, s.at_s, s.value_ms) for s in tick.tpot_samples] == [
        ("decode-2", NOW - 1, 20.0)
    ]


def test_decode_rate_is_running_requests_over_tpot() -> None:
    tick = build_tick(
        0,
        NOW,
        [
            snap("decode-0", WorkerRole.DECODE, running=4),  # own median TPOT 20 ms: 200 tok/s
            snap("decode-1", WorkerRole.DECODE, running=2),  # no own samples: median 25 ms
        ],
        [signals(tpot=[("decode-0", 20.0), ("decode-0", 20.0), ("decode-9", 50.0)])],
    )
    assert tick.decode_tokens_per_s == pytest.approx(4 * 1000 / 20 + 2 * 1000 / 20)


def test_prefill_rate_is_passed_through() -> None:
    assert build_tick(0, NOW, [], [], prefill_tokens_per_s=123.0).prefill_tokens_per_s == 123.0


# ---- autoscaler bundles -------------------------------------------------------------------


def test_resource_bundles_leave_out_zeros() -> None:
    placements = [
        ActorPlacement(num_gpus=1, num_cpus=1, resources=(("prefill", 1.0),)),
        ActorPlacement(num_cpus=0, resources=(("decode", 1.0),)),
        ActorPlacement(num_cpus=0),
    ]
    assert resource_bundles(placements) == [
        {"CPU": 1.0, "GPU": 1.0, "prefill": 1.0},
        {"decode": 1.0},
    ]


def test_resource_requester_asks_on_change_and_releases() -> None:
    calls: list[list[dict[str, float]]] = []
    requester = ResourceRequester(lambda bundles: calls.append(bundles))
    p = ActorPlacement(num_cpus=0, resources=(("prefill", 1.0),))
    assert requester.update([p]) is True
    assert requester.update([p]) is False  # unchanged: not asked again
    assert requester.update([p, p]) is True
    requester.release()
    requester.release()  # nothing asked any more: no call
    assert calls == [[{"prefill": 1.0}], [{"prefill": 1.0}, {"prefill": 1.0}], []]


# ---- the loop over a fake controller ------------------------------------------------------


class FakeHost:
    def __init__(self, workers: list[WorkerSnapshot], sigs: list[RouterSignals]) -> None:
        self.workers = workers
        self.sigs = sigs
        self.rebalancing = False
        self.calls: list[tuple[str, str]] = []
        self.events: list[str] = []
        self.since: list[float] = []
        self._n = 100

    async def worker_snapshots(self) -> list[WorkerSnapshot]:
        return list(self.workers)

    async def router_signals(self, since_s: float) -> list[RouterSignals]:
        self.since.append(since_s)
        return list(self.sigs)

    def spawn_worker(self, role: WorkerRole) -> str:
        self._n += 1
        worker_id = f"{role.value}-{self._n}"
        self.calls.append(("spawn", worker_id))
        self.workers.append(snap(worker_id, role, ready_at=None))
        return worker_id

    def begin_switch(self, worker_id: str, role: WorkerRole) -> bool:
        """The controller's role switch (these tests never reach one: refused)."""
        self.calls.append(("switch", worker_id))
        return False

    def begin_drain(self, worker_id: str) -> None:
        self.calls.append(("drain", worker_id))

    def stop_when_drained(self, worker_id: str) -> None:
        self.calls.append(("stop", worker_id))

    def wanted_placements(self) -> list[ActorPlacement]:
        return [
            ActorPlacement(num_cpus=0, resources=((w.role.value, 1.0),))
            for w in self.workers
            if not w.draining
        ]

    def record_event(self, message: str) -> None:
        self.events.append(message)


FAST = PlannerConfig(
    ttft_slo_ms=100.0,
    prefill=RoleBounds(1, 2),
    decode=RoleBounds(1, 1),
    cooldown_ticks=1,
    cold_start_s=10.0,
    min_samples=3,
)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_slow_ttft_starts_a_prefill_worker_and_asks_for_its_node() -> None:
    host = FakeHost(
        [snap("prefill-0", WorkerRole.PREFILL), snap("decode-1", WorkerRole.DECODE)],
        [signals(ttft=[("prefill-0", 900.0)] * 5)],
    )
    asked: list[list[dict[str, float]]] = []
    loop = PlannerLoop(
        PlannerSettings(enabled=True, sample_window_s=20.0, config=FAST),
        host,
        decode_role=WorkerRole.DECODE,
        resources=ResourceRequester(lambda bundles: asked.append(bundles)),
        clock=lambda: NOW,
    )
    decision = run(loop.tick_once())
    assert decision is not None and decision.prefill.add == 1
    assert host.since == [NOW - 20.0]
    assert host.calls == [("spawn", "prefill-101")]
    assert asked == [[{"prefill": 1.0}, {"decode": 1.0}, {"prefill": 1.0}]]
    assert "prefill-101" in host.events[0]
    record = loop.records[-1]
    assert record.acted and record.tick == 0
    assert record.text.startswith("tick 0: prefill: +1 (TTFT p90 900 ms > SLO 100 ms)")


def test_idle_extra_worker_is_drained_then_stopped_and_the_request_shrinks() -> None:
    old = NOW - 600
    host = FakeHost(
        [
            snap("prefill-0", WorkerRole.PREFILL, ready_at=old),
            snap("prefill-5", WorkerRole.PREFILL, ready_at=NOW - 60),
            snap("decode-1", WorkerRole.DECODE, ready_at=old),
        ],
        [],
    )
    asked: list[list[dict[str, float]]] = []
    loop = PlannerLoop(
        PlannerSettings(enabled=True, config=FAST),
        host,
        decode_role=WorkerRole.DECODE,
        resources=ResourceRequester(lambda bundles: asked.append(bundles)),
        clock=lambda: NOW,
    )
    first = run(loop.tick_once())
    assert first is not None and first.prefill.drain == ("prefill-5",)  # youngest, idle
    assert host.calls == [("drain", "prefill-5")]
    host.workers[1] = snap("prefill-5", WorkerRole.PREFILL, ready_at=NOW - 60, draining=True)
    asked.clear()
    second = run(loop.tick_once())
    assert second is not None and second.prefill.stop == ("prefill-5",)
    assert host.calls[-1] == ("stop", "prefill-5")
    host.workers.pop(1)  # stopped
    run(loop.tick_once())
    assert asked[-1] == [{"prefill": 1.0}, {"decode": 1.0}]
    loop.close()
    assert asked[-1] == []  # released at shutdown


def test_busy_draining_worker_is_not_stopped() -> None:
    host = FakeHost(
        [
            snap("prefill-0", WorkerRole.PREFILL),
            snap("prefill-5", WorkerRole.PREFILL, draining=True, inflight=1),
            snap("decode-1", WorkerRole.DECODE),
        ],
        [],
    )
    loop = PlannerLoop(
        PlannerSettings(enabled=True, config=FAST), host, WorkerRole.DECODE, clock=lambda: NOW
    )
    decision = run(loop.tick_once())
    assert decision is not None and decision.prefill.stop == ()
    assert not [c for c in host.calls if c[0] == "stop"]


def test_tick_is_skipped_while_a_rebalance_runs() -> None:
    host = FakeHost([], [])
    host.rebalancing = True
    loop = PlannerLoop(
        PlannerSettings(enabled=True, config=FAST), host, WorkerRole.DECODE, clock=lambda: NOW
    )
    assert run(loop.tick_once()) is None
    assert host.calls == [] and not loop.records


def test_colocated_cluster_never_gets_a_prefill_worker() -> None:
    host = FakeHost([snap("colocated-0", WorkerRole.COLOCATED)], [])
    loop = PlannerLoop(
        PlannerSettings(enabled=True, config=FAST), host, WorkerRole.COLOCATED, clock=lambda: NOW
    )
    decision = run(loop.tick_once())
    assert decision is not None and decision.prefill.add == 0 and host.calls == []


def test_prefill_rate_comes_from_prompt_token_counters() -> None:
    t = [NOW]
    host = FakeHost([snap("prefill-0", WorkerRole.PREFILL, prompt_tokens=1000)], [])
    loop = PlannerLoop(
        PlannerSettings(enabled=True, config=FAST), host, WorkerRole.DECODE, clock=lambda: t[0]
    )
    run(loop.tick_once())
    host.workers = [snap("prefill-0", WorkerRole.PREFILL, prompt_tokens=3000)]
    t[0] = NOW + 4
    assert loop._prefill_rate(t[0], host.workers) == pytest.approx(500.0)


def test_build_tick_takes_the_arrival_rate_and_lengths_since_the_last_tick() -> None:
    sig = RouterSignals(
        RecentSamples(
            (TimedSample("p", NOW - 20, 50.0, 500), TimedSample("p", NOW - 1, 50.0, 60),
             TimedSample("p", NOW - 2, 50.0, 80)),
            (),
        ),
        queued_requests=0,
        inflight_requests=0,
    )  # fmt: skip
    tick = build_tick(0, NOW, [], [sig], since_s=NOW - 5, arrived=Arrivals(50, 15_000))
    assert tick.arrival_rps == pytest.approx(10.0)  # 50 requests in 5 s
    assert tick.mean_prompt_tokens == pytest.approx(300.0)
    assert tick.mean_output_tokens == pytest.approx(70.0)  # the two that finished since
    first = build_tick(0, NOW, [], [sig])
    assert (first.arrival_rps, first.mean_prompt_tokens) == (0.0, 0.0)
    assert first.mean_output_tokens == pytest.approx(640 / 3)  # none since: the window's


def test_the_loop_counts_what_the_routers_received_between_its_ticks(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    t = [NOW]
    host = FakeHost([snap("prefill-0", WorkerRole.PREFILL), snap("decode-1", WorkerRole.DECODE)],
                    [replace(signals(), arrived=Arrivals(100, 20_000))] * 2)  # fmt: skip
    settings = PlannerSettings(enabled=True, trace_path=str(trace), config=FAST)
    loop = PlannerLoop(settings, host, WorkerRole.DECODE, clock=lambda: t[0])
    run(loop.tick_once())
    host.sigs = [replace(signals(), arrived=Arrivals(130, 29_000)),
                 replace(signals(), arrived=Arrivals(100, 20_000))]  # fmt: skip
    t[0] = NOW + 5
    run(loop.tick_once())
    host.sigs = [replace(signals(), arrived=Arrivals(10, 1_000))]  # a router restarted
    t[0] = NOW + 10
    run(loop.tick_once())
    loop.close()
    ticks = read_trace(trace).ticks
    assert [tk.arrival_rps for tk in ticks] == [0.0, pytest.approx(6.0), pytest.approx(2.0)]
    assert ticks[1].mean_prompt_tokens == pytest.approx(300.0)


def test_every_tick_goes_to_the_replayable_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    host = FakeHost(
        [snap("prefill-0", WorkerRole.PREFILL), snap("decode-1", WorkerRole.DECODE)],
        [signals(ttft=[("prefill-0", 50.0)] * 3)],
    )
    settings = PlannerSettings(enabled=True, trace_path=str(trace), config=FAST)
    loop = PlannerLoop(settings, host, WorkerRole.DECODE, clock=lambda: NOW)
    run(loop.tick_once())
    run(loop.tick_once())
    loop.close()
    recorded = read_trace(trace)
    assert recorded.config == FAST
    assert [t.tick for t in recorded.ticks] == [0, 1]
    assert json.loads(trace.read_text().splitlines()[1])["ttft_samples"][0]["value_ms"] == 50.0


# ---- config -------------------------------------------------------------------------------


def test_settings_from_a_config_mapping() -> None:
    settings = settings_from_dict(
        {
            "enabled": True,
            "interval_s": 2,
            "request_resources": False,
            "ttft_slo_ms": 800,
            "prefill": {"max_workers": 3},
        }
    )
    assert settings.enabled and settings.interval_s == 2 and not settings.request_resources
    assert settings.config.ttft_slo_ms == 800
    assert settings.config.prefill == RoleBounds(1, 3)


def test_the_predictive_knobs_come_from_the_config_mapping() -> None:
    settings = settings_from_dict(
        {"mode": "predictive", "predictive": {"trend_damping_s": float("inf"), "drain_step": 2}}
    )
    assert settings.predictive.trend_damping_s == float("inf")
    assert settings.predictive.drain_step == 2
    with pytest.raises(ValueError, match="drain_step"):
        settings_from_dict({"predictive": {"drain_step": 0}})


def test_unknown_planner_field_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown fields.*ttft_slo"):
        settings_from_dict({"ttft_slo": 800})


# ---- the router side of the signals -------------------------------------------------------


def test_router_metrics_keep_timestamped_samples_for_the_planner() -> None:
    import time

    from router.metrics import RouterMetrics

    metrics = RouterMetrics()
    before = time.time()
    metrics.observe_request("ok", 0.25, 0.02, 1.0, "prefill-0", "decode-1")
    metrics.observe_request("ok", 0.5, None, 1.0, "decode-1", "decode-1")  # local prefill
    recent = metrics.recent_samples(before)
    assert [(s.worker_id, s.value_ms) for s in recent.ttft] == [
        ("prefill-0", 250.0),
        ("decode-1", 500.0),
    ]
    assert [(s.worker_id, round(s.value_ms, 6)) for s in recent.tpot] == [("decode-1", 20.0)]
    assert all(before <= s.at_s <= time.time() for s in recent.ttft)
    assert metrics.recent_samples(time.time() + 1) == RecentSamples((), ())
