"""The gRPC face of the router: thin servicers that translate proto ⇄ frozen dataclasses.

`GenerationServicer.Generate` validates (INVALID_ARGUMENT names the field), hands the
request to the orchestrator and streams its deltas; every error leaves through
`router.errors.to_grpc_failure`. With API keys on (router/auth.py; the server's interceptor has
refused calls without one already) the tenant is the key's, and a tenant's responses name no
worker: `timings.prefill_worker` / `decode_worker` are empty and worker ids in error messages
are replaced (they would tell one tenant where, and so beside whom, its requests ran; cached
token counts stay, since the prefix cache is the tenant's own: vocabulary/block_hash.py). An admin
key, or auth off, sees them. `AdminServicer` serves status, thresholds, drain and
rebalance for the CLI. A request whose bytes are not valid protobuf (e.g. a string field that
is not UTF-8) is answered INVALID_ARGUMENT naming the field, not INTERNAL: the method is
registered with a deserializer that keeps such requests instead of failing the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from admission.config import THRESHOLD_FIELDS, InvalidAdmissionConfig
from admission.controller import AdmissionController
from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc
from router.auth import AuthFailure, KeyTable, redact_workers, sees_workers
from router.cluster_view import ClusterView
from router.control import ClusterControl, LoraEntry, LoraRefused
from router.errors import DEFAULT_RETRY_AFTER_MS, RETRY_AFTER_KEY, to_grpc_failure, unwrap
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator, StreamDelta
from router.request_spans import grpc_caller_context
from router.validation import (
    MAX_LORA_NAME_CHARS,
    InvalidRequest,
    ValidationLimits,
    check_name,
    find_invalid_utf8_field,
    validate,
)
from vocabulary.engine_io import FinishReason
from vocabulary.tokenizer import Tokenizer
from vocabulary.worker_api import WorkerLoad, WorkerRole, WorkerState

log = logging.getLogger(__name__)

DEFAULT_DRAIN_S = 120.0

_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_STOP,
}
_STATE = {
    WorkerState.STARTING: pb.WORKER_STATE_STARTING,
    WorkerState.READY: pb.WORKER_STATE_READY,
    WorkerState.DRAINING: pb.WORKER_STATE_DRAINING,
    WorkerState.DRAINED: pb.WORKER_STATE_DRAINED,
    WorkerState.STOPPED: pb.WORKER_STATE_DEAD,
}


def _worker_state(alive: bool, load: WorkerLoad | None) -> pb.WorkerState:
    """DEAD once polls fail; STARTING while registered but not yet polled (a new worker after
    a rebalance or replacement); DRAINED for a draining worker that holds nothing; else what
    the worker reported."""
    if not alive:
        return pb.WORKER_STATE_DEAD
    if load is None:
        return pb.WORKER_STATE_STARTING
    if load.state is WorkerState.DRAINING and not (load.inflight_requests or load.leases_held):
        return pb.WORKER_STATE_DRAINED
    return _STATE[load.state]


@dataclass(frozen=True)
class UndecodableRequest:
    """Bytes that do not parse as a GenerateRequest, with the bad field when known."""

    field: str | None
    error: str


def decode_generate_request(data: bytes) -> pb.GenerateRequest | UndecodableRequest:
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as e:
        return UndecodableRequest(find_invalid_utf8_field(data), str(e))


def to_proto(delta: StreamDelta, request_id: str, show_workers: bool = True) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=request_id, token_ids=delta.token_ids, text=delta.text)
    if delta.logprobs is not None:
        msg.logprobs.extend(delta.logprobs)
    for top in delta.top_logprobs or ():
        msg.top_logprobs.add(token_ids=top.token_ids, logprobs=top.logprobs)
    prompt = delta.prompt_logprobs
    if prompt is not None:
        msg.prompt_logprobs.logprobs.extend(lp for lp in prompt.logprobs[1:] if lp is not None)
        for top in prompt.top[1:]:
            msg.prompt_logprobs.top_logprobs.add(token_ids=top.token_ids, logprobs=top.logprobs)
    if delta.finish_reason is not None:
        msg.finish_reason = _FINISH[delta.finish_reason]
    if delta.usage is not None:
        u = delta.usage
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                cached_prompt_tokens=u.cached_prompt_tokens,
                transferred_prompt_tokens=u.transferred_prompt_tokens,
            )
        )
    if delta.timings is not None:
        t = delta.timings
        msg.timings.CopyFrom(
            pb.Timings(
                queue_ms=t.queue_ms,
                prefill_ms=t.prefill_ms,
                transfer_ms=t.transfer_ms,
                ttft_ms=t.ttft_ms,
                tpot_ms=t.tpot_ms,
                e2e_ms=t.e2e_ms,
                prefill_worker=t.prefill_worker if show_workers else "",
                decode_worker=t.decode_worker if show_workers else "",
                local_prefill=t.local_prefill,
            )
        )
    return msg


class GenerationServicer:
    def __init__(
        self,
        orchestrator: Orchestrator,
        tokenizer: Tokenizer,
        limits: ValidationLimits,
        max_concurrent_requests: int = 4096,
        keys: KeyTable | None = None,
    ) -> None:
        self.orchestrator = orchestrator
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_concurrent_requests = max_concurrent_requests
        self.keys = keys or KeyTable()

    async def Generate(
        self,
        request: pb.GenerateRequest | UndecodableRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.GenerateResponse]:
        requests = self.orchestrator.metrics.requests
        metadata = context.invocation_metadata()
        try:
            principal = self.keys.from_metadata(metadata)
        except AuthFailure as e:  # the interceptor refuses these first; never served
            await context.abort(e.code, e.message)
            return
        show_workers = sees_workers(principal)
        if isinstance(request, UndecodableRequest):
            requests.labels("invalid").inc()
            field = request.field or "request"
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{field}: not valid UTF-8 / protobuf"
            )
            return
        if self.orchestrator.inflight >= self.max_concurrent_requests:
            requests.labels("rejected").inc()
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(DEFAULT_RETRY_AFTER_MS)),))
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the router holds {self.orchestrator.inflight} requests, its limit "
                f"(max_concurrent_requests {self.max_concurrent_requests}); retry later",
            )
            return
        started = False
        try:
            tenant = principal.tenant if principal is not None else None
            trace = grpc_caller_context(metadata)
            valid = validate(request, self.tokenizer, self.limits, tenant, trace)
            started = True
            # aclosing: a client that goes away while a message is being written closes this
            # generator at its yield; close the orchestrator's at once too (its cleanup frees
            # worker blocks and the admission reservation), not whenever it is collected.
            stream = self.orchestrator.generate(valid, context.time_remaining())
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    yield to_proto(delta, valid.request_id, show_workers)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            failure = to_grpc_failure(e)
            if not started:  # the orchestrator counts the requests it started
                requests.labels(failure.outcome).inc()
            if failure.code is grpc.StatusCode.INTERNAL:
                log.exception("request failed with an internal error")
            if failure.trailing_metadata:
                context.set_trailing_metadata(failure.trailing_metadata)
            message = failure.message if show_workers else redact_workers(failure.message)
            await context.abort(failure.code, message)


def generation_handler(servicer: GenerationServicer) -> grpc.GenericRpcHandler:
    """The Generation service with the lenient request deserializer (see module docstring)."""
    method = grpc.unary_stream_rpc_method_handler(
        servicer.Generate,
        request_deserializer=decode_generate_request,
        response_serializer=pb.GenerateResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler("pdserve.v1.Generation", {"Generate": method})


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(
        self,
        view: ClusterView,
        admission: AdmissionController,
        orchestrator: Orchestrator,
        metrics: RouterMetrics,
        control: ClusterControl | None,
        model_id: str,
        limits: Callable[[], pb.RequestLimits] | None = None,
        http_url: Callable[[], str] | None = None,
        grpc_target: Callable[[], str] | None = None,
    ) -> None:
        self.view = view
        self.admission = admission
        self.orchestrator = orchestrator
        self.metrics = metrics
        self.control = control
        self.model_id = model_id
        self.limits = limits
        self.http_url = http_url
        self.grpc_target = grpc_target

    def _thresholds(self) -> pb.AdmissionThresholds:
        t = self.admission.thresholds
        return pb.AdmissionThresholds(**{f: getattr(t, f) for f in THRESHOLD_FIELDS})

    async def Status(self, request: pb.StatusRequest, context: Any) -> pb.ClusterStatus:
        workers = []
        for entry in sorted(self.view.entries.values(), key=lambda e: e.worker_id):
            info, load = entry.info, entry.load
            lat = self.metrics.latency(info.worker_id)
            w = pb.WorkerStatus(
                worker_id=info.worker_id,
                role=info.role.value,
                node=info.node,
                device=info.device,
                state=_worker_state(entry.alive, load),
                weights_dtype=info.weights_dtype,
                quantization=info.quantization,
                weight_bytes=info.weight_bytes,
                kv_cache_dtype=info.kv_cache_dtype,
                kv_cache_bytes=info.kv_cache_bytes,
                tp_size=info.tp_size,
                pp_size=info.pp_size,
                kv_layout=info.kv_layout,
                ttft_p50_ms=lat.ttft_p50_ms,
                ttft_p90_ms=lat.ttft_p90_ms,
                tpot_p50_ms=lat.tpot_p50_ms,
                tpot_p90_ms=lat.tpot_p90_ms,
            )
            if load is not None:
                e = load.engine
                w.kv_blocks_total = e.num_total_blocks
                w.kv_blocks_used = e.num_total_blocks - e.num_free_blocks
                w.queued_requests = e.num_waiting
                w.queued_prefill_tokens = e.num_waiting_prefill_tokens
                w.running_requests = e.num_running
                w.inflight_transfers = (
                    load.transfer.in_flight_transfers + load.transfer.queued_transfers
                )
                w.inflight_transfer_blocks = load.transfer.pending_blocks + load.leased_blocks
                w.prefix_cache_hit_tokens = e.num_cache_hit_tokens
                w.requests_done = load.requests_done
                w.inflight_requests = load.inflight_requests
                w.open_fds = load.process.fds
                w.threads = load.process.threads
                w.asyncio_tasks = load.process.tasks
                if e.split is not None:
                    w.split.CopyFrom(pb.SplitStatus(**dataclasses.asdict(e.split)))
            workers.append(w)
        redis_ok = self.orchestrator.index is not None and bool(
            await asyncio.to_thread(self.orchestrator.index.live_workers)
        )
        return pb.ClusterStatus(
            model=self.model_id,
            workers=workers,
            thresholds=self._thresholds(),
            router_inflight_requests=self.orchestrator.inflight,
            redis_ok=redis_ok,
            limits=self.limits() if self.limits is not None else None,
            http_url=self.http_url() if self.http_url is not None else "",
            grpc_target=self.grpc_target() if self.grpc_target is not None else "",
        )

    async def GetThresholds(self, request: Any, context: Any) -> pb.AdmissionThresholds:
        return self._thresholds()

    async def SetThresholds(
        self, request: pb.AdmissionThresholds, context: Any
    ) -> pb.AdmissionThresholds:
        changes = {f: getattr(request, f) for f in THRESHOLD_FIELDS if request.HasField(f)}
        try:
            merged = self.admission.thresholds.with_changes(**changes)
        except InvalidAdmissionConfig as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.admission.set_thresholds(merged)
        return self._thresholds()

    async def Drain(self, request: pb.DrainRequest, context: Any) -> pb.DrainResponse:
        control = await self._control(context)
        timeout_s = await self._drain_timeout(request, context)
        await self._known_worker(request.worker_id, context)
        try:
            report = await control.drain(request.worker_id, request.stop, timeout_s, request.force)
        except Exception as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(unwrap(e)))
        await self.view.refresh_registry()
        return pb.DrainResponse(
            worker_id=request.worker_id,
            drained=report.drained,
            message=report.message,
            requests_at_start=report.requests_at_start,
            requests_cut=report.requests_cut,
            stopped=report.stopped,
        )

    async def Switch(self, request: pb.SwitchRequest, context: Any) -> pb.SwitchResponse:
        control = await self._control(context)
        roles = [r.value for r in WorkerRole]
        if request.role not in roles:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"role: one of {', '.join(roles)}, got {request.role!r}",
            )
        timeout_s = await self._drain_timeout(request, context)
        await self._known_worker(request.worker_id, context)
        try:
            done = await control.switch(request.worker_id, request.role, timeout_s, request.force)
        except Exception as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(unwrap(e)))
        await self.view.refresh_registry()
        await self.view.poll_loads()
        return pb.SwitchResponse(
            worker_id=request.worker_id,
            switched=done.switched,
            role=done.info.role.value,
            message=done.message,
            requests_at_start=done.requests_at_start,
            drain_s=done.drain_s,
            flip_s=done.flip_s,
        )

    async def _drain_timeout(self, request: Any, context: Any) -> float:
        """A drain's or switch's `timeout_s` (unset: DEFAULT_DRAIN_S); INVALID_ARGUMENT when
        it is not a finite number >= 0."""
        timeout_s = request.timeout_s if request.HasField("timeout_s") else DEFAULT_DRAIN_S
        if not math.isfinite(timeout_s) or timeout_s < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"timeout_s: must be a finite number >= 0, got {timeout_s}",
            )
        return float(timeout_s)

    async def Undrain(self, request: pb.UndrainRequest, context: Any) -> pb.UndrainResponse:
        control = await self._control(context)
        await self._known_worker(request.worker_id, context)
        try:
            message = await control.undrain(request.worker_id)
        except Exception as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(unwrap(e)))
        await self.view.refresh_registry()
        await self.view.poll_loads()
        return pb.UndrainResponse(worker_id=request.worker_id, message=message)

    async def _control(self, context: Any) -> ClusterControl:
        if self.control is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no controller in this cluster")
        assert self.control is not None
        return self.control

    async def _known_worker(self, worker_id: str, context: Any) -> None:
        if self.view.get(worker_id) is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"worker_id: unknown worker {worker_id!r}"
            )

    async def Rebalance(self, request: pb.RebalanceRequest, context: Any) -> pb.RebalanceResponse:
        control = await self._control(context)
        if request.decode < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decode: must be >= 1")
        timeout_s = request.timeout_s or 300.0
        if not math.isfinite(timeout_s) or timeout_s < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"timeout_s: must be a finite number >= 0, got {timeout_s}",
            )
        try:
            report = await control.rebalance(
                request.prefill, request.decode, timeout_s, request.restart
            )
        except Exception as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(unwrap(e)))
        await self.view.refresh_registry()
        return pb.RebalanceResponse(
            started=report.started,
            stopped=report.stopped,
            switched=report.switched,
            message=report.message,
        )

    # ---- LoRA adapters ------------------------------------------------------------------------

    async def LoadLora(self, request: pb.LoadLoraRequest, context: Any) -> pb.LoraStatus:
        control = await self._control(context)
        await self._check_lora_name(request.name, context)
        if not request.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "path: must not be empty")
        entries = await self._lora_call(context, control.load_lora(request.name, request.path))
        await self.view.poll_loads()  # requests naming it pass validation from now on
        return _lora_status(entries, f"loaded {request.name!r} from {request.path}")

    async def UnloadLora(self, request: pb.UnloadLoraRequest, context: Any) -> pb.LoraStatus:
        control = await self._control(context)
        await self._check_lora_name(request.name, context)
        entries = await self._lora_call(context, control.unload_lora(request.name))
        await self.view.poll_loads()
        return _lora_status(entries, f"unloaded {request.name!r}")

    async def ListLoras(self, request: pb.ListLorasRequest, context: Any) -> pb.LoraStatus:
        control = await self._control(context)
        return _lora_status(await self._lora_call(context, control.list_loras()), "")

    async def _check_lora_name(self, name: str, context: Any) -> None:
        try:
            check_name("name", name, MAX_LORA_NAME_CHARS)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _lora_call(self, context: Any, call: Awaitable[list[LoraEntry]]) -> list[LoraEntry]:
        try:
            return await call
        except Exception as e:
            cause = unwrap(e)
            if not isinstance(cause, LoraRefused):
                raise
            code = (
                grpc.StatusCode.NOT_FOUND if cause.not_found else grpc.StatusCode.INVALID_ARGUMENT
            )
            await context.abort(code, str(cause))
            raise  # (abort raises)


def _lora_status(entries: list[LoraEntry], message: str) -> pb.LoraStatus:
    return pb.LoraStatus(
        adapters=[
            pb.LoraAdapter(
                name=e.name, path=e.path, rank=e.rank, workers=e.workers, loaded_on=e.loaded_on
            )
            for e in entries
        ],
        message=message,
    )
