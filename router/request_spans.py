"""One request's trace on the router: the spans the orchestrator opens, what they say, and
the caller's W3C trace context (a `traceparent` in gRPC metadata or an HTTP header).

The tree of one disaggregated request (worker spans come from their processes, children of
the context the request carried there; see vocabulary/tracing.py for the switch):

    pdserve.request                  SERVER  the router's whole request (child of the caller's
                                             span when the call carried a traceparent)
      pdserve.admission                      the admission decision and queue wait
      pdserve.placement                      each attempt's workers
      pdserve.prefill                CLIENT  the prefill worker's call
        pdserve.prefill_worker.prefill  SERVER  queue + prompt on the prefill worker
      pdserve.decode                 CLIENT  the decode worker's stream, submit → last chunk
        pdserve.kv_handoff                   submit → first chunk (pull, joining the batch);
                                             pdserve.local_prefill when it prefills alone
        pdserve.decode_stream                first chunk → the finish reason
        pdserve.decode_worker.kv_pull   SERVER  the NIXL read on the decode worker
        pdserve.decode_worker.decode    SERVER  from joining the batch to the last token

Attributes are `pdserve.*` (docs/operations.md lists them). Untraced (tracing off, or a
router that does not trace), `request_trace` returns `NO_TRACE` and every span here is
`NO_SPAN`: the helpers below look at `span.recording` before they read anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from router.placement import Placement
from router.progress import RequestProgress, RequestRecord
from router.validation import ValidRequest
from vocabulary.decode_api import DecodeRequest, TokenChunk
from vocabulary.prefill_api import PrefillResult
from vocabulary.tracing import (
    FLUSH_AFTER_S,
    NO_SPAN,
    DeferredSpans,
    Span,
    SpanKind,
    TraceContext,
    open_request_span,
    open_span,
    quietly,
    tracing_enabled,
)

REQUEST = "pdserve.request"
ADMISSION = "pdserve.admission"
PLACEMENT = "pdserve.placement"
PREFILL = "pdserve.prefill"
DECODE = "pdserve.decode"
KV_HANDOFF = "pdserve.kv_handoff"
LOCAL_PREFILL = "pdserve.local_prefill"
DECODE_STREAM = "pdserve.decode_stream"

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"


class RequestTrace:
    """The root span of one request and the stage spans under it.

    Every span of it is deferred (vocabulary/tracing.py, `open_span`): while the request
    runs they record times and attributes in plain values; they are made in the SDK when it
    finishes, so its tokens do not wait for the SDK (docs/benchmarks.md, "Tracing")."""

    def __init__(self, root: Span, deferred: DeferredSpans) -> None:
        self.root = root
        self.deferred = deferred

    def span(self, name: str, kind: SpanKind = SpanKind.INTERNAL) -> Span:
        """A stage span under the root (`with trace.span(...) as span:` ends it)."""
        return open_span(name, self.root, kind, deferred=self.deferred)

    def finish(self, outcome: str, record: RequestRecord, progress: RequestProgress) -> None:
        """End the root with what the request did (its status is an error unless ok), then
        make the spans in the SDK `FLUSH_AFTER_S` later, once the stream's end has gone out
        (the orchestrator finishes a request before the servicer sends its status)."""
        if self.root.recording:
            quietly(self._finish, outcome, record, progress)
            self.deferred.flush_later(FLUSH_AFTER_S)

    def _finish(self, outcome: str, record: RequestRecord, progress: RequestProgress) -> None:
        root = self.root
        root.set("pdserve.status", outcome)
        root.set("pdserve.output_tokens", progress.completion_tokens)
        root.set("pdserve.cached_tokens", record.cached_prompt_tokens)
        root.set("pdserve.transferred_tokens", record.transferred_prompt_tokens)
        root.set("pdserve.decode_worker", record.decode_worker)
        if record.prefill_worker:
            root.set("pdserve.prefill_worker", record.prefill_worker)
        if record.ttft_s is not None:
            root.set("pdserve.ttft_ms", record.ttft_s * 1000)
        if progress.migrations:
            root.set("pdserve.migrations", progress.migrations)
        root.end(None if outcome == "ok" else _Outcome(outcome))


NO_TRACE = RequestTrace(NO_SPAN, DeferredSpans())


class _Outcome(Exception):
    """How a request that was not ok ended (the root span's error status)."""


def request_trace(req: ValidRequest, client_request_id: str) -> RequestTrace:
    """The trace of a request (under the worker-facing id `req.request_id`): NO_TRACE when
    this router does not trace."""
    if not tracing_enabled():
        return NO_TRACE
    deferred = DeferredSpans()
    root = open_request_span(REQUEST, req.trace, SpanKind.SERVER, deferred)
    if root.recording:
        root.set("pdserve.request_id", client_request_id)
        root.set("pdserve.router_request_id", req.request_id)
        root.set("pdserve.prompt_tokens", len(req.prompt_token_ids))
        root.set("pdserve.max_tokens", req.sampling.max_tokens)
    return RequestTrace(root, deferred)


# ---- the caller's context --------------------------------------------------------------------


def grpc_caller_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> TraceContext | None:
    """The W3C context in a gRPC call's metadata (keys are lower case there), or None (also
    whenever this router does not trace)."""
    if metadata is None or not tracing_enabled():
        return None
    parent = state = ""
    for key, value in metadata:
        if key == TRACEPARENT:
            parent = value if isinstance(value, str) else value.decode(errors="replace")
        elif key == TRACESTATE:
            state = value if isinstance(value, str) else value.decode(errors="replace")
    return (parent, state) if parent else None


def http_caller_context(headers: Mapping[str, str]) -> TraceContext | None:
    """The W3C context in an HTTP request's headers (Starlette's are case-insensitive)."""
    if not tracing_enabled():
        return None
    parent = headers.get(TRACEPARENT)
    return (parent, headers.get(TRACESTATE, "")) if parent else None


# ---- what the stage spans say -----------------------------------------------------------------
# Each helper looks at `span.recording` first (untraced: nothing else runs) and never raises:
# a bug here is logged, the request goes on.


def placed(span: Span, placement: Placement, attempt: int) -> None:
    if span.recording:
        quietly(_placed, span, placement, attempt)


def _placed(span: Span, placement: Placement, attempt: int) -> None:
    span.set("pdserve.attempt", attempt)
    span.set("pdserve.decode_worker", placement.decode_worker_id)
    span.set("pdserve.local_prefill", placement.local_prefill)
    span.set("pdserve.uncached_tokens", placement.uncached_tokens)
    span.set("pdserve.prefill_reason", placement.reason.value)
    if placement.prefill_worker_id is not None:
        span.set("pdserve.prefill_worker", placement.prefill_worker_id)


def prefilled(span: Span, result: PrefillResult) -> None:
    if span.recording:
        quietly(_prefilled, span, result)


def _prefilled(span: Span, result: PrefillResult) -> None:
    span.set("pdserve.worker_id", result.worker_id)
    span.set("pdserve.prompt_tokens", result.num_prompt_tokens)
    span.set("pdserve.cached_tokens", result.num_cached_prompt_tokens)
    if result.handle is not None:
        span.set("pdserve.kv_blocks", result.handle.num_blocks)


def first_phase(span: Span, dreq: DecodeRequest, worker_id: str) -> Span:
    """Under the decode span: the wait for the first chunk (the hand-off, or a prefill on the
    decode worker alone)."""
    if not span.recording:
        return NO_SPAN
    span.set("pdserve.worker_id", worker_id)
    return open_span(KV_HANDOFF if dreq.handle is not None else LOCAL_PREFILL, span)


def first_chunk(phase: Span, span: Span, chunk: TokenChunk) -> Span:
    """End the first phase with what the first chunk reports; open the stream's span."""
    if not span.recording:
        return NO_SPAN
    quietly(_first_chunk, phase, chunk)
    return open_span(DECODE_STREAM, span)


def _first_chunk(phase: Span, chunk: TokenChunk) -> None:
    phase.set("pdserve.transferred_tokens", chunk.num_transferred_tokens)
    phase.set("pdserve.transfer_ms", chunk.transfer_s * 1000)
    phase.end()


def stream_ended(
    phase: Span, progress: RequestProgress, chunk: TokenChunk | None, error: BaseException | None
) -> None:
    """End the decode call's open phase (`error`: how it failed, None when it finished)."""
    if phase.recording:
        quietly(_stream_ended, phase, progress, chunk, error)


def _stream_ended(
    phase: Span, progress: RequestProgress, chunk: TokenChunk | None, error: BaseException | None
) -> None:
    phase.set("pdserve.output_tokens", progress.completion_tokens)
    if chunk is not None and chunk.finish_reason is not None:
        phase.set("pdserve.finish_reason", chunk.finish_reason.value)
    phase.end(error)
