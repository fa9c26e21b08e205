"""The OpenAI-compatible HTTP door of one router: a FastAPI app over its orchestrator.

    POST /v1/completions, /v1/chat/completions   stream (SSE) or not
    GET  /v1/models, /v1/models/{model}
    GET  /health   200 while the router runs
    GET  /ready    200 while a decode-capable worker is ready (prefill workers are optional:
                   a decode worker prefills what no prefill worker takes), else 503

One request path: the body becomes validated requests (router/http/translate.py), the
router's concurrency limit applies as on gRPC, each choice is one `Orchestrator.generate`
(admission, placement, prefill, hand-off, decode), and every failure leaves through
router/http/errors.py, which maps router/errors.py's status on.

With API keys on (router/auth.py), every route but /health and /ready needs
`Authorization: Bearer KEY` (401 without a valid one, before the body is read); the tenant is
the key's (the `x-pdserve-tenant` header is ignored), and a tenant's error messages name no
worker.

A stream's status is decided by its first token: the door waits for it before it answers,
so a request refused by admission (429), one no worker can take (503) or one past its
deadline (504) gets that status, not a 200 with an error inside. An error after that is a
`data: {"error": ...}` event, then `data: [DONE]`. A client that goes away aborts its
requests at once (a stream when the server notices the closed connection, a non-streaming
request as soon as the connection closes): the workers drop them and free their blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from router.auth import AuthFailure, KeyTable, Principal, redact_workers, sees_workers
from router.cluster_view import ClusterView
from router.errors import DEFAULT_RETRY_AFTER_MS
from router.http.errors import HttpFailure, failure, to_http_failure
from router.http.fanout import Fanout
from router.http.protocol import ChatCompletionRequest, CompletionRequest
from router.http.responses import DONE, ChoiceOutput, ResponseWriter
from router.http.translate import GenerationPlan, Translator
from router.orchestrator import Orchestrator
from router.progress import StreamDelta

log = logging.getLogger(__name__)

_CLIENT_GONE = ConnectionAbortedError("the client closed the connection")
_OPEN_PATHS = frozenset({"/health", "/ready"})
"""Routes that need no API key (probes)."""
_PRINCIPAL = "pdserve.principal"
"""The ASGI scope key the authenticated caller is kept under."""


class OpenAIDoor:
    """The routes, over one router's orchestrator, translator and cluster view."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        translator: Translator,
        view: ClusterView,
        max_concurrent_requests: int,
        max_body_bytes: int,
        keys: KeyTable | None = None,
    ) -> None:
        self.orchestrator = orchestrator
        self.translator = translator
        self.view = view
        self.max_concurrent_requests = max_concurrent_requests
        self.max_body_bytes = max_body_bytes
        self.keys = keys or KeyTable()
        self.created = int(time.time())

    def app(self) -> ASGIApp:
        app = FastAPI(title="pdserve", summary="OpenAI-compatible API", redoc_url=None)

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request) -> Response:
            tenant = _tenant(request)
            return await self._serve(
                request, lambda: self.translator.completion(body, request.headers, tenant)
            )

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest, request: Request) -> Response:
            tenant = _tenant(request)
            return await self._serve(
                request, lambda: self.translator.chat(body, request.headers, tenant)
            )

        @app.get("/v1/models")
        async def models() -> Response:
            adapters = [self._model(name) for name in self.view.lora_names()]
            return _json({"object": "list", "data": [self._model(), *adapters]})

        @app.get("/v1/models/{model:path}")
        async def model(model: str) -> Response:
            if model == self.translator.model_id:
                return _json(self._model())
            if model in self.view.lora_names():
                return _json(self._model(model))
            return _error(failure(404, f"model: the model {model!r} does not exist",
                                  "model", "model_not_found"))  # fmt: skip

        @app.get("/health")
        async def health() -> Response:
            return _json({"status": "ok"})

        @app.get("/ready")
        async def ready() -> Response:
            decode, prefill = len(self.view.decode_workers()), len(self.view.prefill_workers())
            body = {"status": "ready" if decode else "not ready", "decode_workers": decode,
                    "prefill_workers": prefill}  # fmt: skip
            return _json(body, 200 if decode else 503)

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError) -> Response:
            self.orchestrator.metrics.requests.labels("invalid").inc()
            return _error(_shape_failure(exc))

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, exc: HTTPException) -> Response:
            return _error(failure(exc.status_code, f"{request.url.path}: {exc.detail}"))

        limited = _BodyLimit(app, self.max_body_bytes)
        return _Authenticated(limited, self.keys) if self.keys.enabled else limited

    def _model(self, lora: str = "") -> dict[str, Any]:
        """The served model, or (`lora`) one of its adapters (`parent`: the model)."""
        base = self.translator.model_id
        entry = {"id": lora or base, "object": "model", "created": self.created,
                 "owned_by": "pdserve",
                 "max_model_len": self.translator.limits().max_model_len}  # fmt: skip
        if lora:
            entry |= {"root": lora, "parent": base}
        return entry

    # ---- one request --------------------------------------------------------------------------

    async def _serve(self, request: Request, make_plan: Callable[[], GenerationPlan]) -> Response:
        requests = self.orchestrator.metrics.requests
        redact = not sees_workers(request.scope.get(_PRINCIPAL))
        try:
            plan = make_plan()
        except Exception as e:
            f = _logged(e, redact)
            requests.labels(f.outcome).inc()
            return _error(f)
        inflight = self.orchestrator.inflight
        if inflight + len(plan.choices) > self.max_concurrent_requests:
            requests.labels("rejected").inc()
            return _error(HttpFailure(
                429, "rate_limit_error", f"the router holds {inflight} requests, its limit "
                f"(max_concurrent_requests {self.max_concurrent_requests}); retry later",
                code="rate_limit_exceeded", retry_after_ms=DEFAULT_RETRY_AFTER_MS,
            ))  # fmt: skip
        writer = ResponseWriter(
            plan, plan.model or self.translator.model_id, self.translator.tokenizer
        )
        if not plan.stream:
            return await self._whole(request, plan, writer, redact)
        if len(plan.choices) == 1:
            return await self._stream_one(plan, writer, redact)
        return await self._stream_many(plan, writer, redact)

    async def _whole(
        self, request: Request, plan: GenerationPlan, writer: ResponseWriter, redact: bool
    ) -> Response:
        """Every choice to its end, then one response; the client leaving aborts them."""
        fanout = Fanout(plan, self.orchestrator.generate)
        outputs = [ChoiceOutput(c.index, c.prompt_index) for c in plan.choices]
        watch = asyncio.create_task(_disconnected(request))
        watch.add_done_callback(lambda _: fanout.put((-1, _CLIENT_GONE)))
        fanout.start()
        try:
            running = len(outputs)
            while running:
                index, item = await fanout.next()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    if item is _CLIENT_GONE:
                        return Response(status_code=499)  # nobody reads it
                    return _error(_logged(item, redact, plan))
                else:
                    outputs[index].add(item)
        finally:
            watch.cancel()
            await fanout.close()
        return _json(writer.response(outputs))

    async def _stream_one(
        self, plan: GenerationPlan, writer: ResponseWriter, redact: bool
    ) -> Response:
        """One choice: the orchestrator's stream straight to the client (no task between)."""
        stream = self.orchestrator.generate(plan.choices[0].request, plan.timeout_s)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            return _error(to_http_failure(RuntimeError("the request ended without output")))
        except Exception as e:
            return _error(_logged(e, redact, plan))
        out = ChoiceOutput(0, 0)

        async def events() -> AsyncIterator[bytes]:
            try:
                for event in self._events(writer, out, first):
                    yield event
                async for delta in stream:
                    for event in self._events(writer, out, delta):
                        yield event
                if plan.include_usage:
                    yield writer.usage_chunk([out])
            except Exception as e:
                yield writer.error_event(_logged(e, redact, plan).body())
            yield DONE

        return _EventStream(events(), stream.aclose)

    async def _stream_many(
        self, plan: GenerationPlan, writer: ResponseWriter, redact: bool
    ) -> Response:
        """Several choices: their deltas interleaved as they come."""
        fanout = Fanout(plan, self.orchestrator.generate)
        outputs = [ChoiceOutput(c.index, c.prompt_index) for c in plan.choices]
        fanout.start()
        index, item = await fanout.next()
        if isinstance(item, BaseException) or item is None:
            await fanout.close()
            return _error(_logged(item or RuntimeError("ended without output"), redact, plan))
        first: StreamDelta = item

        async def events() -> AsyncIterator[bytes]:
            try:
                running = len(outputs)
                for event in self._events(writer, outputs[index], first):
                    yield event
                while running:
                    i, got = await fanout.next()
                    if got is None:
                        running -= 1
                    elif isinstance(got, BaseException):
                        raise got
                    else:
                        for event in self._events(writer, outputs[i], got):
                            yield event
                if plan.include_usage:
                    yield writer.usage_chunk(outputs)
            except Exception as e:
                yield writer.error_event(_logged(e, redact, plan).body())
            yield DONE

        return _EventStream(events(), fanout.close)

    @staticmethod
    def _events(writer: ResponseWriter, out: ChoiceOutput, delta: StreamDelta) -> list[bytes]:
        out.add(delta)
        event = writer.chunk(out, delta)
        return [event] if event is not None else []


class _EventStream(StreamingResponse):
    """An SSE response that closes its request's streams however it ends, also when the
    client left before the first event (Starlette then never starts the body iterator)."""

    def __init__(self, events: AsyncIterator[bytes], close: Callable[[], Awaitable[None]]) -> None:
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # A send cut short leaves the events generator at a yield: close it, then the
            # request's own streams (an `async for` left by an exception closes nothing).
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._close()


class _Authenticated:
    """Refuses a request without a valid API key (401, or 403) before anything reads its
    body; keeps the caller in the scope for the routes (`_tenant`)."""

    def __init__(self, app: ASGIApp, keys: KeyTable) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"").decode(errors="replace")
        try:
            scope[_PRINCIPAL] = self.keys.authenticate(header)
        except AuthFailure as e:
            denied = failure(e.http_status, e.message, "authorization", _AUTH_CODES[e.http_status])
            await _error(denied)(scope, receive, send)
            return
        await self.app(scope, receive, send)


_AUTH_CODES = {401: "invalid_api_key", 403: "permission_denied"}


def _tenant(request: Request) -> str | None:
    """The caller's tenant from its API key (None: auth off)."""
    principal: Principal | None = request.scope.get(_PRINCIPAL)
    return principal.tenant if principal is not None else None


class _BodyLimit:
    """Reads a request's body up to `max_bytes` before the app does: a longer one is
    refused with 413 (declared or not), as gRPC refuses messages over max_message_bytes."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        size = int(declared) if declared.isdigit() else 0
        chunks: list[bytes] = []
        while size <= self.max_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            chunks.append(chunk)
            if not message.get("more_body"):
                break
            size += len(chunk)
        size = max(size, sum(len(c) for c in chunks))
        if size > self.max_bytes:
            too_large = failure(413, f"body: {size} bytes or more, over the {self.max_bytes} "
                                "bytes a request may have (max_message_bytes)", "body")  # fmt: skip
            await _error(too_large)(scope, receive, send)
            return
        body, replayed = b"".join(chunks), False

        async def replay() -> Any:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _disconnected(request: Request) -> None:
    """Return when the client has closed the connection (the body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _json(body: Any, status: int = 200) -> Response:
    return Response(json.dumps(body), status, media_type="application/json")


def _error(f: HttpFailure) -> Response:
    return Response(f.body(), f.status, f.headers(), media_type="application/json")


def _logged(
    exc: BaseException, redact: bool = False, plan: GenerationPlan | None = None
) -> HttpFailure:
    """The failure `exc` ends a request with (worker ids replaced for a tenant), a field
    named as `plan`'s body names it."""
    f = to_http_failure(exc, plan.param_name if plan is not None else str)
    if f.status == 500:
        log.error("request failed with an internal error", exc_info=exc)
    return replace(f, message=redact_workers(f.message)) if redact else f


def _shape_failure(exc: RequestValidationError) -> HttpFailure:
    """A body that is not JSON, or whose field has the wrong type, naming the field
    (`messages[0].role`)."""
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        return failure(400, "body: not valid JSON", "body")
    parts = [p for p in err.get("loc", ()) if p != "body"]
    if not parts:
        return failure(400, "body: must be a JSON object (content-type: application/json)", "body")
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
    return failure(400, f"{param}: {err.get('msg', 'invalid')}", param)
