"""What a router exports: per-worker series rendered from the latest load poll (engine steps,
prefix-cache tokens, transfers, the index publisher, the state), goodput against the SLOs, and
every request outcome and rejection reason present from the start (as zeros)."""

from __future__ import annotations

import json
import socket
from dataclasses import replace
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from router_fakes import make_load

from admission.decision import Reason
from prefix_index.config import PrefixIndexConfig
from prefix_index.index import PrefixIndex
from router.metrics import OUTCOMES, RouterMetrics, SloTargets
from router.placement import Placement, PrefillReason
from vocabulary.block_hash import BlockHash
from vocabulary.engine_io import HostTierStats, TierMoveStats
from vocabulary.kv_events import PublisherStats
from vocabulary.step_stats import StepMeter
from vocabulary.transfer_load import TransferLoad, TransferStats
from vocabulary.worker_api import WorkerLoad, WorkerRole, WorkerState

WORKER_FAMILIES = Path(__file__).with_name("worker_metric_families.json")
"""Every per-worker family as exposed: name, type, help and label names, in exposition order."""


def scrape(metrics: RouterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def decode_load() -> WorkerLoad:
    meter = StepMeter()
    meter.record(2, 40, 0, 0.003)
    meter.record(2, 0, 2, 0.0004)
    load = make_load("decode-1", WorkerRole.DECODE, used_blocks=30)
    tier = HostTierStats(num_blocks=512, num_cached=40, num_offloaded=70, num_onboarded=12,
                         num_evicted=3, num_fenced=0, offload_bytes=70 << 10,
                         onboard_bytes=12 << 10, num_pinned=5, num_lent=7,
                         onboard=TierMoveStats(queued_blocks=9, inflight_blocks=4, done_blocks=12,
                                               done_bytes=12 << 10, wait_s=0.25, deferred=2),
                         offload=TierMoveStats(queued_blocks=30, done_bytes=70 << 10,
                                               wait_s=1.5))  # fmt: skip
    engine = replace(load.engine, num_cache_query_tokens=64, num_cache_hit_tokens=48,
                     num_waiting=3, steps=meter.snapshot(), num_host_hit_tokens=32,
                     host_tier=tier)  # fmt: skip
    return replace(
        load,
        state=WorkerState.DRAINING,
        engine=engine,
        transfer=TransferLoad(in_flight_blocks=6, queued_blocks=2, max_inflight_blocks=8),
        transfer_stats=TransferStats(
            transfers_done=5, transfers_failed=1, bytes_transferred=1 << 20, transfer_seconds=0.5
        ),
        index=PublisherStats(running=True, connected=False, applied_seq=9, pending_events=4,
                             num_resyncs=2, num_errors=3, last_error="ConnectionError: x"),
    )  # fmt: skip


def test_worker_series_come_from_the_latest_load_report() -> None:
    metrics = RouterMetrics()
    metrics.observe_load(decode_load())
    got = scrape(metrics)
    w = (("role", "decode"), ("worker", "decode-1"))

    def at(name: str, *extra: tuple[str, str]) -> float:
        return got[(name, tuple(sorted((*w, *extra))))]

    assert at("pdserve_worker_kv_blocks_used") == 30
    assert at("pdserve_worker_kv_blocks_total") == 100
    assert at("pdserve_worker_waiting_requests") == 3
    assert at("pdserve_worker_state", ("state", "draining")) == 1
    assert at("pdserve_worker_state", ("state", "ready")) == 0
    assert at("pdserve_worker_prefix_cache_query_tokens_total") == 64
    assert at("pdserve_worker_prefix_cache_hit_tokens_total") == 48
    assert at("pdserve_worker_host_kv_hit_tokens_total") == 32
    assert at("pdserve_worker_host_kv_blocks") == 512
    assert at("pdserve_worker_host_kv_cached_blocks") == 40
    assert at("pdserve_worker_host_kv_blocks_moved_total", ("direction", "offload")) == 70
    assert at("pdserve_worker_host_kv_blocks_moved_total", ("direction", "onboard")) == 12
    assert at("pdserve_worker_host_kv_evicted_blocks_total") == 3
    assert at("pdserve_worker_host_kv_pinned_blocks") == 5
    assert at("pdserve_worker_host_kv_handoff_blocks_total") == 7
    onboard, offload = ("direction", "onboard"), ("direction", "offload")
    assert at("pdserve_worker_host_kv_bytes_moved_total", onboard) == 12 << 10
    assert at("pdserve_worker_host_kv_bytes_moved_total", offload) == 70 << 10
    assert at("pdserve_worker_host_kv_queued_blocks", onboard) == 9
    assert at("pdserve_worker_host_kv_queued_blocks", offload) == 30
    assert at("pdserve_worker_host_kv_inflight_blocks", onboard) == 4
    assert at("pdserve_worker_host_kv_wait_seconds_total", offload) == 1.5
    assert at("pdserve_worker_host_kv_deferred_total", onboard) == 2
    assert at("pdserve_worker_engine_step_seconds_count") == 2
    assert at("pdserve_worker_engine_step_seconds_bucket", ("le", "0.0005")) == 1
    assert at("pdserve_worker_engine_step_seconds_bucket", ("le", "0.0025")) == 1
    assert at("pdserve_worker_engine_step_seconds_bucket", ("le", "0.005")) == 2
    assert at("pdserve_worker_engine_step_seconds_bucket", ("le", "+Inf")) == 2
    assert at("pdserve_worker_engine_batch_requests_sum") == 4
    assert at("pdserve_worker_engine_tokens_total", ("kind", "prefill")) == 40
    assert at("pdserve_worker_engine_tokens_total", ("kind", "decode")) == 2
    assert at("pdserve_worker_transfer_inflight_blocks") == 6
    assert at("pdserve_worker_transfer_budget_blocks") == 8
    assert at("pdserve_worker_transfer_blocks") == 8  # pending: queued + in flight
    assert at("pdserve_worker_transfer_bytes_total") == 1 << 20
    assert at("pdserve_worker_transfer_seconds_total") == 0.5
    assert at("pdserve_worker_transfers_total", ("result", "done")) == 5
    assert at("pdserve_worker_transfers_total", ("result", "failed")) == 1
    assert at("pdserve_worker_index_connected") == 0
    assert at("pdserve_worker_index_resyncs_total") == 2
    assert at("pdserve_worker_index_pending_events") == 4
    assert at("pdserve_worker_index_publish_errors") == 0  # the load's own field
    assert 0 <= at("pdserve_worker_load_age_seconds") < 5


def test_worker_families_keep_their_names_types_help_and_labels() -> None:
    metrics = RouterMetrics()
    metrics.observe_load(decode_load())  # a worker with every part: host tier, transfers, index
    text = generate_latest(metrics.registry).decode()
    got = [
        {
            "name": family.name,
            "type": family.type,
            "help": family.documentation,
            "labels": sorted({label for s in family.samples for label in s.labels}),
        }
        for family in text_string_to_metric_families(text)
        if family.name.startswith("pdserve_worker_")
    ]
    assert got == json.loads(WORKER_FAMILIES.read_text())


def test_prefill_worker_without_index_has_no_transfer_or_index_series() -> None:
    metrics = RouterMetrics()
    metrics.observe_load(make_load("prefill-0", WorkerRole.PREFILL))
    names = {name for name, labels in scrape(metrics) if ("worker", "prefill-0") in labels}
    assert "pdserve_worker_kv_blocks_used" in names
    assert "pdserve_worker_engine_step_seconds_count" in names
    assert not {n for n in names if n.startswith(("pdserve_worker_transfer_bytes",
                                                  "pdserve_worker_index_connected"))}  # fmt: skip


def test_a_worker_that_left_the_registry_has_no_series() -> None:
    metrics = RouterMetrics()
    metrics.observe_load(decode_load())
    metrics.forget_worker("decode-1", "decode")
    assert not [key for key in scrape(metrics) if ("worker", "decode-1") in key[1]]


def test_a_request_that_ends_after_its_worker_left_keeps_no_latency_window_for_it() -> None:
    """A worker's TTFT/TPOT window goes with it (`forget_worker`); a request still in flight
    on it when it left must not bring the window back (one per departed worker, forever)."""
    metrics = RouterMetrics()
    metrics.observe_load(make_load("prefill-0", WorkerRole.PREFILL))
    metrics.observe_load(make_load("decode-1", WorkerRole.DECODE))
    metrics.observe_request("ok", 0.1, 0.01, 1.0, "prefill-0", "decode-1")
    assert metrics.latency("decode-1").tpot_p50_ms == 10.0
    metrics.forget_worker("decode-1", "decode")
    metrics.observe_request("ok", 0.1, 0.02, 1.0, "prefill-0", "decode-1")  # it was in flight
    assert "decode-1" not in metrics._tpot
    assert metrics.latency("prefill-0").ttft_p50_ms == 100.0  # the worker still in view counts
    assert scrape(metrics)[("pdserve_tpot_seconds_count", ())] == 2  # the histogram has both


def test_goodput_counts_ok_requests_within_both_slos() -> None:
    metrics = RouterMetrics(SloTargets(ttft_ms=200, tpot_ms=20))
    metrics.observe_request("ok", 0.1, 0.01, 1.0, "p", "d")  # good
    metrics.observe_request("ok", 0.2, None, 0.2, "p", "d")  # one token: TTFT decides; good
    metrics.observe_request("ok", 0.3, 0.01, 1.0, "p", "d")  # TTFT over
    metrics.observe_request("ok", 0.1, 0.03, 1.0, "p", "d")  # TPOT over
    metrics.observe_request("deadline", 0.1, 0.01, 1.0, "p", "d")  # not ok
    got = scrape(metrics)
    assert got[("pdserve_goodput_requests_total", ())] == 2
    assert got[("pdserve_slo_seconds", (("metric", "ttft"),))] == 0.2
    assert got[("pdserve_slo_seconds", (("metric", "tpot"),))] == 0.02


def test_every_outcome_and_rejection_reason_is_exported_before_it_happens() -> None:
    got = scrape(RouterMetrics())
    for outcome in OUTCOMES:
        assert got[("pdserve_requests_total", (("outcome", outcome),))] == 0
    for reason in Reason:
        decision = "admit" if reason is Reason.ADMITTED else "reject"
        key = (("decision", decision), ("reason", reason.value))
        assert got[("pdserve_admission_decisions_total", key)] == 0


def test_placements_are_counted_by_where_the_prompt_was_prefilled_and_why() -> None:
    metrics = RouterMetrics()
    zero = scrape(metrics)
    for why in PrefillReason:
        site = "local" if why.local else "remote"
        key = ("pdserve_prefill_placements_total", (("reason", why.value), ("site", site)))
        assert zero[key] == 0.0
    metrics.observe_placement(Placement("d0", None, 0, 16, PrefillReason.LOCAL_CHEAPER))
    metrics.observe_placement(Placement("d0", "p0", 0, 64, PrefillReason.REMOTE_CHEAPER))
    metrics.observe_placement(Placement("d0", "p0", 0, 64, PrefillReason.REMOTE_CHEAPER))
    got = scrape(metrics)
    local = (("reason", "local_cheaper"), ("site", "local"))
    remote = (("reason", "remote_cheaper"), ("site", "remote"))
    assert got["pdserve_prefill_placements_total", local] == 1.0
    assert got["pdserve_prefill_placements_total", remote] == 2.0


def test_prefix_index_lookups_that_found_redis_down_are_counted() -> None:
    with socket.socket() as s:  # a port nothing listens on: Redis is down
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    index = PrefixIndex(f"redis://127.0.0.1:{port}", "tiny", PrefixIndexConfig(retry_after_s=60))
    metrics = RouterMetrics()
    metrics.watch_index(index)
    chain = [BlockHash(bytes(16))]
    assert not index.lookup(chain).available  # refused: the circuit breaker opens
    assert not index.lookup(chain).available  # answered at once, unavailable
    got = scrape(metrics)
    assert got[("pdserve_prefix_index_lookups_total", ())] == 2
    assert got[("pdserve_prefix_index_unavailable_total", ())] == 2
    index.close()
