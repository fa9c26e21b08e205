"""Traces: the W3C trace context a request carries across the Ray boundary, and this
process's tracer, configured from the standard `OTEL_*` environment variables.

Off unless `OTEL_TRACES_EXPORTER` names an exporter (and `OTEL_SDK_DISABLED` is not true).
Off, `open_span` returns `NO_SPAN` after one check of a module global: no span, context or
carrier is ever built, and opentelemetry is not even imported. A router (the orchestrator,
router/request_spans.py) opens a request's root span, continuing the caller's trace when the call
carried one; a worker only opens child spans of a context that a request brought
(`PrefillRequest.trace`, `DecodeRequest.trace`), so a request the router did not trace costs
a worker nothing either.

Exporters are found by name in the `opentelemetry_traces_exporter` entry-point group, as the
SDK's own configurator finds them: `console` (the SDK), `otlp_proto_http` (the OTLP/HTTP
exporter; `otlp` means it unless `OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL` says `grpc`, which
needs `opentelemetry-exporter-otlp-proto-grpc` installed), and `pdserve_memory`, the SDK's
in-memory exporter, whose spans `finished_spans()` reads back (tests, debugging: the actors
answer it). Each sits behind a `BatchSpanProcessor` (`OTEL_BSP_*`); the SDK reads the rest:
`OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES` (the service name defaults to
`pdserve-<role>`), `OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_EXPORTER_OTLP_*`, span limits.
`tracing_env()` is what deploy/control/launch.py hands every actor it starts.

Tracing never fails a request: exporters run on the processor's thread, which logs their
errors; an exporter that cannot be built leaves this process untraced (logged once); a span
operation that raises is logged and dropped.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from random import getrandbits
from time import time_ns
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)

EXPORTER_ENV = "OTEL_TRACES_EXPORTER"
EXPORTER_GROUP = "opentelemetry_traces_exporter"
MEMORY_EXPORTER = "pdserve_memory"
"""The exporter name (an entry point of pdserve's) of the SDK's in-memory exporter."""

AttributeValue = str | int | float | bool


TraceContext = tuple[str, str]
"""A span's W3C trace context (https://www.w3.org/TR/trace-context/) as it travels with a
request to another process: the `traceparent` and `tracestate` header values ("": none).

A plain tuple, not a class: Ray pickles builtins natively, where a frozen dataclass of these
two strings cost ~9 µs more per Ray call and a NamedTuple ~17 (a request makes two traced
calls; docs/benchmarks.md, "Tracing")."""


class SpanKind(enum.Enum):
    INTERNAL = "internal"
    SERVER = "server"
    """The callee's side of a call: a router's request span, a worker's span of a Ray call."""
    CLIENT = "client"
    """The caller's side of a worker call (its context travels in the request)."""


class Span:
    """An open span. This class itself is the span of an untraced path (`NO_SPAN`): every
    method does nothing. `end` (or leaving a `with` block) ends it once; an error ends it
    with an error status naming the exception."""

    __slots__ = ()
    recording = False

    def set(self, key: str, value: AttributeValue) -> None:
        """Set attribute `key` (pdserve's are named `pdserve.*`)."""

    def carrier(self) -> TraceContext | None:
        """This span's context for a request going to another process (None: untraced)."""
        return None

    def end(self, error: BaseException | None = None) -> None:
        pass

    def __enter__(self) -> Span:
        return self

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        self.end(error)


NO_SPAN = Span()


@dataclass
class _Tracing:
    """What `configure_tracing` set up in this process (the SDK's objects, built once)."""

    tracer: Tracer
    provider: TracerProvider
    exporters: list[SpanExporter]
    role: str
    kinds: dict[SpanKind, Any]
    ids: Any
    """The provider's `_Ids` (a deferred span is made with the span id it chose up front)."""


_tracing: _Tracing | None = None
_active: _Tracing | None = None
"""What spans are opened with: None when tracing is off (or paused)."""


def tracing_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The `OTEL_*` variables of this process: the actors a cluster starts get them (a Ray
    worker process does not inherit the driver's environment)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k.startswith("OTEL_")}


def exporter_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """The entry-point names `OTEL_TRACES_EXPORTER` asks for; empty means tracing is off."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip() for n in env.get(EXPORTER_ENV, "").split(",") if n.strip()]
    if [n.lower() for n in names] == ["none"] or not names:
        return []
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or ""
    ).strip()
    otlp = "otlp_proto_grpc" if protocol.strip() == "grpc" else "otlp_proto_http"
    return [otlp if n == "otlp" else n for n in names if n.lower() != "none"]


def configure_tracing(role: str) -> bool:
    """Set up this process's tracer from its `OTEL_*` environment (once: a later call keeps
    the first set-up); `role` names the default service (`pdserve-<role>`). True when it
    traces."""
    global _tracing, _active
    if _tracing is not None:
        return True
    names = exporter_names()
    if not names:
        return False
    try:
        _tracing = _build(role, names)
    except Exception as e:
        log.warning("tracing stays off in this %s process: %s", role, e)
        return False
    _active = _tracing
    log.info("tracing on (%s), exporters %s", role, ", ".join(names))
    return True


def _build(role: str, names: list[str]) -> _Tracing:
    from importlib.metadata import entry_points

    from opentelemetry import trace
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    exporters: list[SpanExporter] = []
    for name in names:
        found = list(entry_points(group=EXPORTER_GROUP, name=name))
        if not found:
            raise RuntimeError(f"{EXPORTER_ENV}: no trace exporter named {name!r} is installed")
        exporter = found[0].load()()
        if not isinstance(exporter, SpanExporter):
            raise RuntimeError(f"{EXPORTER_ENV}: {name!r} is not a span exporter")
        exporters.append(exporter)
    resource = Resource.create({"pdserve.role": role})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: f"pdserve-{role}"}))
    ids = _Ids()
    # duck-typed (the module may not import opentelemetry at its top: off, it is never loaded)
    provider = TracerProvider(resource=resource, id_generator=cast("IdGenerator", ids))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    kinds = {
        SpanKind.INTERNAL: trace.SpanKind.INTERNAL,
        SpanKind.SERVER: trace.SpanKind.SERVER,
        SpanKind.CLIENT: trace.SpanKind.CLIENT,
    }
    return _Tracing(
        provider.get_tracer("pdserve"), provider, exporters, role, kinds,
        ids,
    )  # fmt: skip


def tracing_enabled() -> bool:
    """True when spans are being opened in this process (the one check of a traced path)."""
    return _active is not None


def pause_tracing(paused: bool) -> bool:
    """Stop (or resume) opening spans, keeping the exporters; True when it traces now. A
    benchmark compares the two in one process (`python -m benchmarks tracing`)."""
    global _active
    _active = None if paused else _tracing
    return _active is not None


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Export what is pending (within `timeout_s`) and turn tracing off in this process."""
    global _tracing, _active
    current, _tracing, _active = _tracing, None, None
    if current is None:
        return
    try:
        current.provider.force_flush(int(timeout_s * 1000))
        current.provider.shutdown()
    except Exception as e:
        log.warning("tracing shutdown: %s", e)


def open_span(
    name: str,
    parent: Span | TraceContext | None,
    kind: SpanKind = SpanKind.INTERNAL,
    deferred: DeferredSpans | None = None,
) -> Span:
    """A span, child of `parent`: an open span of this process (the span goes into that
    span's sink), or a context another process sent (it goes into `deferred`). `NO_SPAN`
    when tracing is off, without a parent, or when the context is invalid or not sampled.

    Every span is on some request's latency path, so it only records its times and
    attributes in plain values; it is made in the SDK when its sink's `flush()` runs, off
    that path (the span id it will have is chosen now, so `carrier()` works at once)."""
    if _active is None or parent is None or parent is NO_SPAN:
        return NO_SPAN
    if isinstance(parent, _Deferred):
        return _Deferred(
            name, kind, parent.sink, parent.trace_id, parent.span_id, parent.flags, parent.state
        )
    if not isinstance(parent, tuple) or deferred is None:
        raise TypeError(f"span {name}: a parent span, or a trace context and `deferred`")
    return _remote_child(name, parent, kind, deferred)


class _Ids:
    """The provider's id generator: random ids (the SDK's own), but the next span id is the
    one `forced` holds while a deferred span is made (set and cleared on one thread)."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        self._random = RandomIdGenerator()
        self.forced: int | None = None
        self.forced_trace: int | None = None

    def generate_span_id(self) -> int:
        forced, self.forced = self.forced, None
        return forced if forced is not None else self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        forced, self.forced_trace = self.forced_trace, None
        return forced if forced is not None else self._random.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        return True


def _remote_parent(traceparent: str) -> tuple[int, int, int] | None:
    """(trace id, span id, flags) of a valid `traceparent`, else None."""
    parts = traceparent.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, flags


FLUSH_AFTER_S = 0.005
"""How long after a traced call replies (or a stream ends) its deferred spans are made in the
SDK, so the reply goes out first (made at once, they were on the request's latency:
docs/benchmarks.md, "Tracing")."""


class DeferredSpans:
    """The deferred spans of one request (or one worker call), made in the SDK by `flush`."""

    def __init__(self) -> None:
        self.spans: list[_Deferred] = []

    def flush_later(self, delay_s: float) -> None:
        """`flush` `delay_s` from now on the running event loop, so what the caller is about
        to send (a reply, a stream's end) goes first; at once when no loop runs here."""
        if not self.spans:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        loop.call_later(delay_s, self.flush)

    def flush(self) -> None:
        """Make every span recorded so far (one still open ends now); never raises."""
        spans, self.spans = self.spans, []
        t = _active or _tracing
        if t is None:
            return
        for span in spans:
            try:
                span.make(t)
            except Exception as e:
                log.warning("deferred span %s not made: %s", span.name, e)


def open_request_span(
    name: str, caller: TraceContext | None, kind: SpanKind, sink: DeferredSpans
) -> Span:
    """A request's root span, deferred into `sink` (see `open_span`): a child of the
    caller's context, or the first span of a new trace, which this process's sampler
    decides on now (`NO_SPAN` when tracing is off, the caller's context is invalid or not
    sampled, or the sampler drops the new trace)."""
    t = _active
    if t is None:
        return NO_SPAN
    if caller is not None:
        return _remote_child(name, caller, kind, sink)
    try:
        trace_id = t.ids.generate_trace_id()
        decision = t.provider.sampler.should_sample(None, trace_id, name, t.kinds[kind])
        if not decision.decision.is_sampled():
            return NO_SPAN
    except Exception as e:
        log.warning("span %s not opened: %s", name, e)
        return NO_SPAN
    return _Deferred(name, kind, sink, trace_id, 0, 1, "")


def _remote_child(name: str, parent: TraceContext, kind: SpanKind, sink: DeferredSpans) -> Span:
    where = _remote_parent(parent[0])
    if where is None or not where[2] & 1:  # no valid context, or not sampled upstream
        return NO_SPAN
    return _Deferred(name, kind, sink, *where, parent[1])


class _Deferred(Span):
    """A span recorded in plain values (see `open_span`); it joins its sink's
    list as it opens. Opening one is on a request's latency path: a few attribute stores
    (docs/benchmarks.md, "Tracing")."""

    __slots__ = (
        "attributes", "end_ns", "error", "flags", "kind", "name", "parent_id", "sink", "span_id",
        "start_ns", "state", "trace_id",
    )  # fmt: skip
    recording = True

    def __init__(
        self, name: str, kind: SpanKind, sink: DeferredSpans,
        trace_id: int, parent_id: int, flags: int, state: str,
    ) -> None:  # fmt: skip
        self.name = name
        self.kind = kind
        self.sink = sink
        self.trace_id = trace_id
        self.parent_id = parent_id
        """0: this span starts the trace."""
        self.flags = flags
        self.state = state
        self.span_id = getrandbits(64) or 1
        self.start_ns = time_ns()
        self.end_ns = 0
        self.attributes: dict[str, AttributeValue] = {}
        self.error = ""
        sink.spans.append(self)

    def set(self, key: str, value: AttributeValue) -> None:
        self.attributes[key] = value

    def carrier(self) -> TraceContext | None:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{self.flags:02x}", self.state

    def end(self, error: BaseException | None = None) -> None:
        if self.end_ns:
            return
        self.end_ns = time_ns()
        if error is not None:
            what = "cancelled" if _is_cancel(error) else f"{type(error).__name__}: {error}"
            self.error, self.attributes["pdserve.error"] = what, type(error).__name__

    def make(self, t: _Tracing) -> None:
        from opentelemetry import trace

        context = None  # a trace's first span: its trace id is the one chosen up front
        if self.parent_id:
            context = trace.set_span_in_context(
                trace.NonRecordingSpan(
                    trace.SpanContext(
                        self.trace_id, self.parent_id, is_remote=True,
                        trace_flags=trace.TraceFlags(self.flags),
                        trace_state=trace.TraceState.from_header([self.state])
                        if self.state else None,
                    )
                )
            )  # fmt: skip
        else:
            t.ids.forced_trace = self.trace_id
        t.ids.forced = self.span_id
        try:
            span = t.tracer.start_span(
                self.name, context, t.kinds[self.kind], attributes=self.attributes,
                start_time=self.start_ns,
            )  # fmt: skip
        finally:
            t.ids.forced = t.ids.forced_trace = None
        if self.error:
            span.set_status(trace.Status(trace.StatusCode.ERROR, self.error))
        span.end(end_time=self.end_ns or time_ns())


def quietly(fn: Callable[..., None], *args: object) -> None:
    """`fn(*args)`, a helper that reads a request's values into a span, with any error it
    raises logged, not raised: a tracing bug must not fail the request."""
    try:
        fn(*args)
    except Exception:
        log.warning("tracing: %s failed (the request goes on)", fn.__name__, exc_info=True)


def _is_cancel(error: BaseException) -> bool:
    import asyncio

    return isinstance(error, (asyncio.CancelledError, GeneratorExit))


# ---- reading spans back (tests, debugging) -------------------------------------------------


@dataclass(frozen=True)
class FinishedSpan:
    """A finished span as the in-memory exporter holds it, in plain values (it crosses Ray)."""

    name: str
    service: str
    trace_id: str
    """32 hex digits."""
    span_id: str
    """16 hex digits."""
    parent_id: str | None
    """The parent's span id (16 hex digits; None for a trace's root)."""
    kind: str
    status: str
    """unset, ok or error."""
    start_ns: int
    end_ns: int
    attributes: dict[str, AttributeValue] = field(default_factory=dict)


def finished_spans(clear: bool = False, timeout_s: float = 5.0) -> list[FinishedSpan]:
    """The spans this process exported to `pdserve_memory` (flushed first, within
    `timeout_s`); empty when it does not trace or exports elsewhere. `clear`: forget them."""
    current = _tracing
    if current is None:
        return []
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    current.provider.force_flush(int(timeout_s * 1000))
    spans: list[FinishedSpan] = []
    for exporter in current.exporters:
        if isinstance(exporter, InMemorySpanExporter):
            spans += [_plain(s) for s in exporter.get_finished_spans()]
            if clear:
                exporter.clear()
    return spans


def _plain(span: ReadableSpan) -> FinishedSpan:
    ctx = span.context
    assert ctx is not None
    parent = span.parent
    return FinishedSpan(
        name=span.name,
        service=str(span.resource.attributes.get("service.name", "")),
        trace_id=f"{ctx.trace_id:032x}",
        span_id=f"{ctx.span_id:016x}",
        parent_id=f"{parent.span_id:016x}" if parent is not None else None,
        kind=span.kind.name.lower(),
        status=span.status.status_code.name.lower(),
        start_ns=span.start_time or 0,
        end_ns=span.end_time or 0,
        attributes=dict(span.attributes or {}),  # type: ignore[arg-type]
    )
