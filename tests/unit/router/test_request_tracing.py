"""Tracing in one process: off without an exporter (no span is built, no context leaves the
router), the orchestrator's span tree with the SDK's in-memory exporter on, and an exporter
that fails without failing the request. The orchestrator runs over the fake worker handles of
test_orchestrator_faults.py (no Ray; tests/integration/observability/test_tracing.py runs the
real processes)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from test_orchestrator_faults import EXPECTED, FakeDecode, FakePrefill, Setup, serve, tokens

from router.request_spans import NO_TRACE, grpc_caller_context, http_caller_context, request_trace
from router.validation import ValidRequest
from vocabulary import tracing
from vocabulary.tracing import NO_SPAN

CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(autouse=True)
def untraced(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in list(tracing.tracing_env()):
        monkeypatch.delenv(key)
    tracing.shutdown_tracing()
    yield
    tracing.shutdown_tracing()


@pytest.fixture()
def traced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "pdserve_memory")
    assert tracing.configure_tracing("router")


def test_exporter_names_follow_otel_traces_exporter() -> None:
    names = tracing.exporter_names
    assert names({}) == [] and names({"OTEL_TRACES_EXPORTER": "none"}) == []
    assert names({"OTEL_TRACES_EXPORTER": " console , otlp "}) == ["console", "otlp_proto_http"]
    grpc = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    assert names(grpc) == ["otlp_proto_grpc"]
    disabled = {"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}
    assert names(disabled) == []
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "x", "PATH": "/bin"}
    assert tracing.tracing_env(env) == {"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "x"}


def test_tracing_off_builds_no_span_and_sends_workers_no_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opentelemetry.sdk import trace as sdk_trace

    built: list[Any] = []
    real_init = sdk_trace.Span.__init__

    def counting_init(self: Any, *args: Any, **kw: Any) -> None:
        built.append(args)
        real_init(self, *args, **kw)

    monkeypatch.setattr(sdk_trace.Span, "__init__", counting_init)
    assert not tracing.configure_tracing("router") and not tracing.tracing_enabled()
    req = ValidRequest("r", (1, 2), None, "", 0, "", (CALLER, ""))  # type: ignore[arg-type]
    assert request_trace(req, "r") is NO_TRACE
    assert tracing.open_span("x", (CALLER, "")) is NO_SPAN
    assert grpc_caller_context((("traceparent", CALLER),)) is None
    assert http_caller_context({"traceparent": CALLER}) is None

    setup = Setup([FakePrefill("prefill-0")], [FakeDecode("decode-1")])
    (got,), _ = serve(setup)
    assert tokens(got) == EXPECTED
    assert setup.prefill[0].prefills[0][0].trace is None
    assert setup.decode[0].submits[0][0].trace is None
    assert built == [] and tracing.finished_spans() == []


def test_a_traced_request_has_the_orchestrators_span_tree(traced: None) -> None:
    setup = Setup([FakePrefill("prefill-0")], [FakeDecode("decode-1")])
    (got,), _ = serve(setup)
    assert tokens(got) == EXPECTED
    spans = {s.name: s for s in tracing.finished_spans()}
    assert set(spans) == {
        "pdserve.request", "pdserve.admission", "pdserve.placement", "pdserve.prefill",
        "pdserve.decode", "pdserve.kv_handoff", "pdserve.decode_stream",
    }  # fmt: skip
    root = spans["pdserve.request"]
    assert root.parent_id is None and root.service == "pdserve-router" and root.kind == "server"
    assert {s.trace_id for s in spans.values()} == {root.trace_id}
    by_id = {s.span_id: s.name for s in spans.values()}
    assert by_id[spans["pdserve.kv_handoff"].parent_id] == "pdserve.decode"  # type: ignore[index]
    assert by_id[spans["pdserve.decode_stream"].parent_id] == "pdserve.decode"  # type: ignore[index]
    assert root.attributes["pdserve.request_id"] == "client-0"
    assert root.attributes["pdserve.output_tokens"] == len(EXPECTED)
    assert root.attributes["pdserve.status"] == "ok"
    assert root.attributes["pdserve.prefill_worker"] == "prefill-0"
    # the workers get the context of the router's span of their call
    prefill_call = setup.prefill[0].prefills[0][0].trace
    decode_call = setup.decode[0].submits[0][0].trace
    assert prefill_call[0].split("-")[2] == spans["pdserve.prefill"].span_id
    assert decode_call[0].split("-")[2] == spans["pdserve.decode"].span_id


def test_a_failed_request_ends_its_root_with_an_error_status(traced: None) -> None:
    from router.errors import WorkerLost

    setup = Setup([FakePrefill("prefill-0", fail_with=[WorkerLost("gone")] * 3)], [])
    (got,), _ = serve(setup)
    assert isinstance(got, Exception)
    (root,) = [s for s in tracing.finished_spans() if s.name == "pdserve.request"]
    assert root.status == "error" and root.attributes["pdserve.status"] != "ok"


def test_an_exporter_that_fails_never_fails_a_request(
    traced: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    def broken(self: Any, spans: Any) -> Any:
        raise ConnectionError("collector down")

    monkeypatch.setattr(InMemorySpanExporter, "export", broken)
    setup = Setup([FakePrefill("prefill-0")], [FakeDecode("decode-1")])
    with caplog.at_level(logging.ERROR):
        (got,), _ = serve(setup)
        tracing.finished_spans()  # flushes: the processor's thread meets the error
    assert tokens(got) == EXPECTED
    assert "collector down" in caplog.text


def test_a_span_helper_that_raises_is_logged_and_the_request_goes_on(
    traced: None, caplog: pytest.LogCaptureFixture
) -> None:
    # the fake prefill's handle is a bare object: reading its blocks raises inside the helper
    setup = Setup([FakePrefill("prefill-0")], [FakeDecode("decode-1")])
    (got,), _ = serve(setup)
    assert tokens(got) == EXPECTED
    assert "tracing: _prefilled failed" in caplog.text


def test_the_caller_context_comes_from_grpc_metadata_and_http_headers(traced: None) -> None:
    metadata = (("authorization", "Bearer k"), ("traceparent", CALLER), ("tracestate", "a=1"))
    assert grpc_caller_context(metadata) == (CALLER, "a=1")
    assert grpc_caller_context((("traceparent", CALLER.encode()),)) == (CALLER, "")
    assert grpc_caller_context(()) is None
    assert http_caller_context({"traceparent": CALLER}) == (CALLER, "")
    assert http_caller_context({}) is None


def test_a_deferred_span_is_made_at_flush_with_the_span_id_its_carrier_named(
    traced: None,
) -> None:
    deferred = tracing.DeferredSpans()
    span = tracing.open_span("stage", (CALLER, "a=1"), deferred=deferred)
    child = tracing.open_span("inner", span)  # a child of a deferred span is deferred too
    span.set("pdserve.request_id", "r1")
    carrier = span.carrier()
    # a builtin tuple, not a class: it rides in Ray calls (docs/benchmarks.md, "Tracing: TTFT
    # overhead")
    assert type(carrier) is tuple and carrier[1] == "a=1"
    inner = child.carrier()  # the caller's tracestate travels on through the children
    assert inner is not None and inner[1] == "a=1"
    _, trace_id, span_id, flags = carrier[0].split("-")
    assert trace_id == CALLER.split("-")[1] and flags == "01"
    child.end()
    span.end(ValueError("bad"))
    assert tracing.finished_spans() == []  # nothing made in the SDK before the flush
    deferred.flush()
    got = {s.name: s for s in tracing.finished_spans()}
    assert got["stage"].span_id == span_id and got["stage"].trace_id == trace_id
    assert got["stage"].parent_id == CALLER.split("-")[2]
    assert got["stage"].attributes["pdserve.request_id"] == "r1"
    assert got["stage"].status == "error" and got["stage"].start_ns <= got["stage"].end_ns
    assert got["inner"].parent_id == span_id and got["inner"].trace_id == trace_id


def test_a_caller_that_did_not_sample_gets_no_deferred_span(traced: None) -> None:
    unsampled = CALLER[:-2] + "00"
    deferred = tracing.DeferredSpans()
    assert tracing.open_span("stage", (unsampled, ""), deferred=deferred) is NO_SPAN
    bad = ("00-xyz-1-01", "")
    assert tracing.open_span("stage", bad, deferred=deferred) is NO_SPAN
