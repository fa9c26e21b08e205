"""The CLI's gRPC client: stream a generation, show cluster status, drain and rebalance."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from rich import box
from rich.console import Console
from rich.table import Table

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    client_ttft_ms: float
    client_tpot_ms: float
    last: pb.GenerateResponse


def stream_generate(
    target: str, request: pb.GenerateRequest, timeout_s: float = 120.0
) -> Iterator[pb.GenerateResponse]:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        yield from stub.Generate(request, timeout=timeout_s)


def generate(
    target: str,
    request: pb.GenerateRequest,
    console: Console | None = None,
    timeout_s: float = 120.0,
) -> GenerationResult:
    """Stream a generation (printing text as it arrives when `console` is given)."""
    t0 = time.perf_counter()
    first = last_t = None
    text, ids = [], []
    last = pb.GenerateResponse()
    for msg in stream_generate(target, request, timeout_s):
        now = time.perf_counter()
        if msg.token_ids:
            first = first if first is not None else now
            last_t = now
        ids += msg.token_ids
        text.append(msg.text)
        if console is not None and msg.text:
            console.print(msg.text, end="", markup=False, highlight=False, soft_wrap=True)
        last = msg
    n = len(ids)
    ttft = ((first or t0) - t0) * 1000
    tpot = ((last_t or 0) - (first or 0)) * 1000 / (n - 1) if n > 1 else 0.0
    return GenerationResult(
        "".join(text), tuple(ids), _FINISH.get(last.finish_reason, "?"), ttft, tpot, last
    )


def timings_line(result: GenerationResult) -> str:
    t, u = result.last.timings, result.last.usage
    path = (
        f"local prefill on {t.decode_worker}"
        if t.local_prefill
        else f"prefill {t.prefill_worker} → decode {t.decode_worker}"
    )
    return (
        f"TTFT {result.client_ttft_ms:.1f} ms · TPOT {result.client_tpot_ms:.1f} ms "
        f"(server: TTFT {t.ttft_ms:.1f}, TPOT {t.tpot_ms:.1f}, prefill {t.prefill_ms:.1f}, "
        f"transfer {t.transfer_ms:.1f}, queue {t.queue_ms:.1f} ms) · "
        f"{u.prompt_tokens} prompt ({u.cached_prompt_tokens} cached, "
        f"{u.transferred_prompt_tokens} transferred) + {u.completion_tokens} tokens · "
        f"finish: {result.finish_reason} · {path}"
    )


def admin(target: str) -> tuple[grpc.Channel, Any]:
    channel = grpc.insecure_channel(target)
    return channel, pb_grpc.AdminStub(channel)


def status(target: str, timeout_s: float = 10.0) -> pb.ClusterStatus:
    channel, stub = admin(target)
    with channel:
        return stub.Status(pb.StatusRequest(), timeout=timeout_s)


@dataclass(frozen=True)
class ControlLogSummary:
    """The tail of the control log: recent controller events and the last planner decision."""

    events: tuple[str, ...] = ()
    planner: str = ""


def control_log_summary(path: str, n_events: int) -> ControlLogSummary:
    from deploy.daemon import tail

    if not path or n_events <= 0:
        return ControlLogSummary()
    lines = tail(path, 2000)
    events = [line for line in lines if " planner tick " not in line]
    planner = [line for line in lines if " planner tick " in line]
    return ControlLogSummary(tuple(events[-n_events:]), planner[-1] if planner else "")


def status_json(st: pb.ClusterStatus, log: ControlLogSummary | None = None) -> str:
    data = MessageToDict(
        st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    if log is not None:
        data["events"] = list(log.events)
        data["planner"] = log.planner
    return json.dumps(data, indent=2)


def status_table(st: pb.ClusterStatus) -> Table:
    table = Table(
        title=f"pdserve · {st.model} · redis {'ok' if st.redis_ok else 'DOWN'}",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    for col in ("worker", "role", "health", "node", "device", "KV used", "queue", "run", "xfer",
                "TTFT p50/90 ms", "TPOT p50/90 ms", "done"):  # fmt: skip
        left = col in ("worker", "role", "health", "node", "device")
        table.add_column(col, justify="left" if left else "right", no_wrap=True)
    for w in st.workers:
        state = pb.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower()
        table.add_row(
            w.worker_id,
            w.role,
            f"[red]{state}[/red]" if w.state == pb.WORKER_STATE_DEAD else state,
            w.node[:8],
            w.device,
            f"{w.kv_blocks_used}/{w.kv_blocks_total}",
            f"{w.queued_requests} ({w.queued_prefill_tokens} tok)",
            str(w.running_requests),
            f"{w.inflight_transfers} ({w.inflight_transfer_blocks} blk)",
            f"{w.ttft_p50_ms:.0f}/{w.ttft_p90_ms:.0f}",
            f"{w.tpot_p50_ms:.1f}/{w.tpot_p90_ms:.1f}",
            str(w.requests_done),
        )
    t = st.thresholds
    table.caption = (
        f"router in-flight {st.router_inflight_requests} · admission: TTFT<= "
        f"{t.max_estimated_ttft_ms:.0f}ms queue<={t.max_queue_wait_ms:.0f}ms "
        f"in-flight<={t.max_inflight_requests} decode-KV<={t.max_decode_kv_utilization:.0%} "
        f"local-prefill<={t.local_prefill_threshold_tokens}tok"
    )
    return table


def drain(target: str, worker_id: str, stop: bool, timeout_s: float) -> pb.DrainResponse:
    channel, stub = admin(target)
    with channel:
        return stub.Drain(
            pb.DrainRequest(worker_id=worker_id, stop=stop, timeout_s=timeout_s),
            timeout=timeout_s + 30,
        )


def rebalance(target: str, prefill: int, decode: int, timeout_s: float) -> pb.RebalanceResponse:
    channel, stub = admin(target)
    with channel:
        return stub.Rebalance(
            pb.RebalanceRequest(prefill=prefill, decode=decode, timeout_s=timeout_s),
            timeout=timeout_s + 900,
        )


def thresholds(target: str, changes: dict[str, float], timeout_s: float = 10.0) -> dict[str, float]:
    """Apply `changes` (may be empty) to a router's admission thresholds; returns them all.

    With several router replicas, each has its own thresholds: this talks to `target` only.
    """
    channel, stub = admin(target)
    with channel:
        if changes:
            request = pb.AdmissionThresholds()
            for name, value in changes.items():
                setattr(request, name, value)
            reply = stub.SetThresholds(request, timeout=timeout_s)
        else:
            reply = stub.GetThresholds(pb.GetThresholdsRequest(), timeout=timeout_s)
    return {f.name: float(getattr(reply, f.name)) for f in reply.DESCRIPTOR.fields}
