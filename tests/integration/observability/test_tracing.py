"""One trace per request across the real processes: the directory's 1P1D cluster (tiny model,
NIXL over UCX on loopback, every prompt disaggregated; conftest.py) whose router and workers
run with `OTEL_TRACES_EXPORTER=pdserve_memory`, so each Ray actor keeps its finished spans in
the SDK's in-memory exporter and hands them back through its `finished_spans()` call. The
environment reaches the actors the way an operator's does: `Cluster.start` passes the
driver's `OTEL_*` variables in the actors' runtime_env (the controller's workers inherit
it)."""

from __future__ import annotations

import json
import secrets
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import pytest

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc
from vocabulary.tracing import FinishedSpan

if TYPE_CHECKING:
    from deploy.control.launch import Cluster

PROMPT = (
    "The lighthouse keeper climbs the stairs every evening, trims the wick, polishes the lens "
    "and writes the weather into a book that nobody has read for forty years."
)
WORKER_SPANS = {
    "pdserve.prefill_worker.prefill": "pdserve-prefill",
    "pdserve.decode_worker.kv_pull": "pdserve-decode",
    "pdserve.decode_worker.decode": "pdserve-decode",
}
ROUTER_SPANS = {
    "pdserve.request", "pdserve.admission", "pdserve.placement", "pdserve.prefill",
    "pdserve.decode", "pdserve.kv_handoff", "pdserve.decode_stream",
}  # fmt: skip


@dataclass
class TracedCluster:
    target: str
    http_url: str
    actors: dict[str, Any]
    """Router and worker actors by what they are ("router", a worker id)."""

    def spans(self, trace_id: str) -> list[FinishedSpan]:
        import ray

        got = ray.get([a.finished_spans.remote() for a in self.actors.values()], timeout=30)
        return [s for spans in got for s in spans if s.trace_id == trace_id]

    def wait_spans(self, trace_id: str, names: set[str], timeout_s: float = 30.0) -> list[Any]:
        """The trace's spans once every name in `names` is among them."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans(trace_id)
            if names <= {s.name for s in spans}:
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"trace {trace_id}: {sorted(s.name for s in spans)}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def traced(observed_cluster: Cluster) -> TracedCluster:
    import ray

    ep = observed_cluster.endpoint
    assert ep is not None
    listed = ray.get(observed_cluster.controller.list_workers.remote(), timeout=30)
    actors = {"router": observed_cluster.routers[0], **{i.worker_id: h for i, h in listed}}
    with grpc.insecure_channel(ep.admin[0]) as channel:
        status = pb_grpc.AdminStub(channel).Status(pb.StatusRequest(), timeout=10)
    return TracedCluster(ep.target, status.http_url, actors)


def caller_context() -> tuple[str, str, str]:
    """A caller's (traceparent, trace id, span id), sampled."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def generate(target: str, metadata: tuple[tuple[str, str], ...] = ()) -> list[Any]:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        req = pb.GenerateRequest(
            request_id="traced-1", prompt=PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True
        )
        return list(stub.Generate(req, timeout=60, metadata=metadata))


def test_a_disaggregated_request_is_one_trace_over_router_prefill_and_decode_processes(
    traced: TracedCluster,
) -> None:
    traceparent, trace_id, caller_span = caller_context()
    messages = generate(traced.target, (("traceparent", traceparent),))
    last = messages[-1]
    assert last.usage.completion_tokens == 6 and not last.timings.local_prefill

    spans = traced.wait_spans(trace_id, ROUTER_SPANS | set(WORKER_SPANS))
    by_name = {s.name: s for s in spans}
    assert len(by_name) == len(spans), sorted(s.name for s in spans)  # one of each
    by_id = {s.span_id: s for s in spans}

    def parent(name: str) -> str:
        return by_id[by_name[name].parent_id].name  # type: ignore[index]

    root = by_name["pdserve.request"]
    assert root.parent_id == caller_span and root.kind == "server"  # the caller's trace
    for name in ("pdserve.admission", "pdserve.placement", "pdserve.prefill", "pdserve.decode"):
        assert parent(name) == "pdserve.request"
    assert parent("pdserve.kv_handoff") == parent("pdserve.decode_stream") == "pdserve.decode"
    assert parent("pdserve.prefill_worker.prefill") == "pdserve.prefill"
    assert parent("pdserve.decode_worker.kv_pull") == "pdserve.decode"
    assert parent("pdserve.decode_worker.decode") == "pdserve.decode"
    # three processes: the router's spans, and each worker's
    for name in ROUTER_SPANS:
        assert by_name[name].service == "pdserve-router", name
    for name, service in WORKER_SPANS.items():
        assert by_name[name].service == service, name
    assert {s.status for s in spans} == {"unset"}

    prefill_worker, decode_worker = last.timings.prefill_worker, last.timings.decode_worker
    attrs = root.attributes
    assert attrs["pdserve.request_id"] == "traced-1"
    assert str(attrs["pdserve.router_request_id"]).startswith("traced-1@")
    assert attrs["pdserve.prompt_tokens"] == last.usage.prompt_tokens
    assert attrs["pdserve.cached_tokens"] == last.usage.cached_prompt_tokens
    assert attrs["pdserve.transferred_tokens"] == last.usage.transferred_prompt_tokens > 0
    assert attrs["pdserve.output_tokens"] == 6
    assert attrs["pdserve.status"] == "ok"
    assert attrs["pdserve.prefill_worker"] == prefill_worker
    assert attrs["pdserve.decode_worker"] == decode_worker

    placement = by_name["pdserve.placement"].attributes
    assert placement["pdserve.prefill_worker"] == prefill_worker
    assert placement["pdserve.local_prefill"] is False
    assert by_name["pdserve.admission"].attributes["pdserve.queued_ms"] >= 0
    on_prefill = by_name["pdserve.prefill_worker.prefill"].attributes
    assert on_prefill["pdserve.worker_id"] == prefill_worker
    assert on_prefill["pdserve.prompt_tokens"] == last.usage.prompt_tokens
    assert on_prefill["pdserve.cached_tokens"] == last.usage.cached_prompt_tokens
    assert on_prefill["pdserve.request_id"] == attrs["pdserve.router_request_id"]
    pull = by_name["pdserve.decode_worker.kv_pull"].attributes
    assert pull["pdserve.prefill_worker"] == prefill_worker
    assert pull["pdserve.kv_blocks"] == on_prefill["pdserve.kv_blocks"]  # nothing cached there
    assert (
        pull["pdserve.kv_bytes"] > 0 and pull["pdserve.kv_bytes"] % pull["pdserve.kv_blocks"] == 0
    )
    assert by_name["pdserve.decode_worker.decode"].attributes["pdserve.worker_id"] == decode_worker
    handoff = by_name["pdserve.kv_handoff"].attributes
    assert handoff["pdserve.transferred_tokens"] == last.usage.transferred_prompt_tokens
    stream = by_name["pdserve.decode_stream"].attributes
    assert stream["pdserve.output_tokens"] == 6 and stream["pdserve.finish_reason"] == "length"
    # the stages lie inside the request, in order
    assert root.start_ns <= by_name["pdserve.admission"].start_ns
    assert by_name["pdserve.prefill"].end_ns <= by_name["pdserve.decode"].start_ns
    assert by_name["pdserve.decode"].end_ns <= root.end_ns


def test_an_http_request_continues_the_traceparent_header(traced: TracedCluster) -> None:
    traceparent, trace_id, caller_span = caller_context()
    body = {"model": _model(traced), "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(
        traced.http_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "traceparent": traceparent},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert json.loads(reply.read())["usage"]["completion_tokens"] == 3
    spans = traced.wait_spans(trace_id, {"pdserve.request", "pdserve.decode_worker.decode"})
    (root,) = [s for s in spans if s.name == "pdserve.request"]
    assert root.parent_id == caller_span


def test_without_a_traceparent_a_request_starts_a_trace_of_its_own(traced: TracedCluster) -> None:
    import ray

    router = traced.actors["router"]
    ray.get(router.finished_spans.remote(clear=True), timeout=30)
    generate(traced.target)
    deadline = time.monotonic() + 30
    roots: list[FinishedSpan] = []
    while not roots and time.monotonic() < deadline:
        spans = ray.get(router.finished_spans.remote(), timeout=30)
        roots = [s for s in spans if s.name == "pdserve.request"]
        time.sleep(0.2)
    (root,) = roots
    assert root.parent_id is None
    traced.wait_spans(root.trace_id, set(WORKER_SPANS))


def test_a_router_that_does_not_trace_sends_workers_no_context(traced: TracedCluster) -> None:
    import ray

    router = traced.actors["router"]
    assert ray.get(router.pause_tracing.remote(True), timeout=30) is False
    try:
        traceparent, trace_id, _ = caller_context()
        generate(traced.target, (("traceparent", traceparent),))
        time.sleep(0.5)  # the processors' schedule delay is 0.1 s
        assert traced.spans(trace_id) == []
    finally:
        assert ray.get(router.pause_tracing.remote(False), timeout=30) is True


def _model(traced: TracedCluster) -> str:
    with urllib.request.urlopen(traced.http_url + "/v1/models", timeout=30) as reply:
        return str(json.loads(reply.read())["data"][0]["id"])
