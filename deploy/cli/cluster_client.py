"""The CLI's gRPC client: stream a generation, show cluster status, drain and rebalance.

Every call opens its channel through `_channel`, which tells "nothing answers at the target"
(`NoRouter`) from a router's own UNAVAILABLE (e.g. no decode worker). A `Target` carries what
a call needs beyond the address: the API key it sends (`authorization: Bearer KEY`) and the
TLS files it verifies the router with (and, for mutual TLS, presents); a plain "HOST:PORT"
string is a target without either.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from google.protobuf.json_format import MessageToDict
from rich import box
from rich.console import Console
from rich.table import Table

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}

DRAIN_TIMEOUT_S = 120.0
"""The server's drain timeout when the request sets none (DrainRequest.timeout_s)."""
CONNECT_TIMEOUT_S = 1.0
"""How long a target that failed an RPC with UNAVAILABLE gets to accept a connection."""


class NoRouter(ConnectionError):
    """Nothing accepts a connection at the target: no cluster runs there, or it is the wrong
    address."""

    def __init__(self, target: str) -> None:
        super().__init__(
            f"no pdserve router answers at {target} (is the cluster up? `pdserve up` starts one)"
        )
        self.target = target


@dataclass(frozen=True)
class Target:
    """A router's address and how to call it."""

    address: str
    """HOST:PORT."""
    key: str = ""
    """API key sent with every call ("" none). Secret: never printed."""
    ca_file: str = ""
    """PEM roots to verify the router's certificate with; set (or a client certificate):
    TLS."""
    cert_file: str = ""
    """Client certificate (mutual TLS), with `key_file`."""
    key_file: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    def __str__(self) -> str:
        return self.address

    def __repr__(self) -> str:
        return f"Target({self.address!r}, key={'set' if self.key else 'none'}, tls={self.tls})"


def resolve(target: str | None, admin: bool) -> Target:
    """The router a CLI command talks to, and how (deploy/cli/app.py's docstring): `target`, else
    the running cluster's first router; its admin plane with `admin` (a running cluster's data
    target stands for its admin plane); the admin key ($PDSERVE_ADMIN_KEY, else the state
    file's, sent only to that cluster) or, on the data plane, $PDSERVE_API_KEY before it; the
    TLS files from $PDSERVE_TLS_CA (else the state file's), $PDSERVE_TLS_CLIENT_CERT / _KEY.
    `daemon.NoCluster` with neither a target nor a running cluster."""
    from deploy.cli import daemon
    from router.auth import ADMIN_KEY_ENV, CLIENT_KEY_ENV

    state = daemon.read_state()
    if target is None and state is None:
        raise daemon.NoCluster()
    address = target or (state.target if state is not None else "")
    if state is not None and admin and state.admin_targets and address in state.targets:
        address = state.admin_targets[state.targets.index(address)]
    ours = state is not None and address in (*state.targets, *state.admin_targets)
    key = os.environ.get(ADMIN_KEY_ENV) or (state.admin_key if ours and state else "")
    if not admin:
        key = os.environ.get(CLIENT_KEY_ENV) or key
    return Target(
        address,
        key=key,
        ca_file=os.environ.get("PDSERVE_TLS_CA") or (state.tls_ca if ours and state else ""),
        cert_file=os.environ.get("PDSERVE_TLS_CLIENT_CERT", ""),
        key_file=os.environ.get("PDSERVE_TLS_CLIENT_KEY", ""),
    )


def as_target(target: Target | str) -> Target:
    return target if isinstance(target, Target) else Target(target)


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer KEY` to every call of a channel."""

    def __init__(self, key: str) -> None:
        self._entry = ("authorization", f"Bearer {key}")

    def _with_key(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self._entry]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)  # fmt: skip

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        return continuation(self._with_key(details), request)


def open_channel(target: Target | str) -> grpc.Channel:
    """A channel to `target`: TLS when it has TLS files, its key on every call."""
    t = as_target(target)
    if t.tls:
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(t.ca_file).read_bytes() if t.ca_file else None,
            private_key=Path(t.key_file).read_bytes() if t.key_file else None,
            certificate_chain=Path(t.cert_file).read_bytes() if t.cert_file else None,
        )
        channel = grpc.secure_channel(t.address, creds)
    else:
        channel = grpc.insecure_channel(t.address)
    return grpc.intercept_channel(channel, _BearerKey(t.key)) if t.key else channel


def _connects(channel: grpc.Channel, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    future = grpc.channel_ready_future(channel)
    try:
        future.result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        future.cancel()
        return False
    return True


@contextmanager
def _channel(target: Target | str) -> Iterator[grpc.Channel]:
    """A channel to `target`, closed on exit. An RPC on it that fails with UNAVAILABLE
    becomes `NoRouter` when the target does not accept a connection either; an UNAVAILABLE
    the router itself sent (it answered) stays what it is."""
    channel = open_channel(target)
    try:
        yield channel
    except grpc.RpcError as e:
        code = e.code() if isinstance(e, grpc.Call) else None
        if code == grpc.StatusCode.UNAVAILABLE and not _connects(channel):
            raise NoRouter(str(target)) from e
        raise
    finally:
        channel.close()


def require_router(target: Target | str, timeout_s: float = 3.0) -> None:
    """Return once `target` accepts a connection; `NoRouter` when it does not in time."""
    with open_channel(target) as channel:
        if not _connects(channel, timeout_s):
            raise NoRouter(str(target))


def rpc_error_line(error: grpc.RpcError) -> str:
    """A failed RPC as one line: its status code, then its details."""
    if not isinstance(error, grpc.Call):
        return " ".join(str(error).split())
    details = " ".join((error.details() or "").split())
    return f"{error.code().name}: {details}" if details else error.code().name


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    client_ttft_ms: float
    client_tpot_ms: float
    last: pb.GenerateResponse


def stream_generate(
    target: Target | str, request: pb.GenerateRequest, timeout_s: float = 120.0
) -> Iterator[pb.GenerateResponse]:
    with _channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        yield from stub.Generate(request, timeout=timeout_s)


def generate(
    target: Target | str,
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
    prefill, decode = (w or "(not shown)" for w in (t.prefill_worker, t.decode_worker))
    path = (
        f"local prefill on {decode}" if t.local_prefill else f"prefill {prefill} → decode {decode}"
    )
    return (
        f"TTFT {result.client_ttft_ms:.1f} ms · TPOT {result.client_tpot_ms:.1f} ms "
        f"(server: TTFT {t.ttft_ms:.1f}, TPOT {t.tpot_ms:.1f}, prefill {t.prefill_ms:.1f}, "
        f"transfer {t.transfer_ms:.1f}, queue {t.queue_ms:.1f} ms) · "
        f"{u.prompt_tokens} prompt ({u.cached_prompt_tokens} cached, "
        f"{u.transferred_prompt_tokens} transferred) + {u.completion_tokens} tokens · "
        f"finish: {result.finish_reason} · {path}"
    )


@contextmanager
def admin(target: Target | str) -> Iterator[Any]:
    """The Admin stub of the router at `target` (see `_channel` for what failures become)."""
    with _channel(target) as channel:
        yield pb_grpc.AdminStub(channel)


def status(target: Target | str, timeout_s: float = 10.0) -> pb.ClusterStatus:
    with admin(target) as stub:
        return stub.Status(pb.StatusRequest(), timeout=timeout_s)


@dataclass(frozen=True)
class ControlLogSummary:
    """The tail of the control log: recent controller events and the last planner decision."""

    events: tuple[str, ...] = ()
    planner: str = ""


def control_log_summary(path: str, n_events: int) -> ControlLogSummary:
    from deploy.cli.daemon import tail

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


_STATE_STYLE = {
    pb.WORKER_STATE_DEAD: "red",
    pb.WORKER_STATE_DRAINING: "yellow",
    pb.WORKER_STATE_DRAINED: "yellow",
    pb.WORKER_STATE_STARTING: "dim",
}


def worker_state(state: int) -> str:
    """ "ready", "draining", "drained", ... for a WorkerState value ("state-7" if unknown)."""
    try:
        return pb.WorkerState.Name(state).removeprefix("WORKER_STATE_").lower()
    except ValueError:
        return f"state-{state}"


def device_column(device: str, tp_size: int, pp_size: int) -> str:
    """A worker's device as the status table shows it: "cuda:0", "cuda:0 x2" (TP ranks),
    "cuda:0 x4 (PP2 x TP2)" (pipeline stages of TP ranks); one worker whatever the count."""
    if pp_size <= 1:
        return f"{device} x{tp_size}" if tp_size > 1 else device
    return f"{device} x{pp_size * tp_size} (PP{pp_size} x TP{max(tp_size, 1)})"


def status_table(st: pb.ClusterStatus) -> Table:
    table = Table(
        title=f"pdserve · {st.model} · redis {'ok' if st.redis_ok else 'DOWN'}",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    for col in ("worker", "role", "health", "node", "device", "weights", "KV pool", "KV used",
                "in-flight", "queue", "run", "xfer", "TTFT p50/90 ms", "TPOT p50/90 ms",
                "done", "fds/thr/tasks"):  # fmt: skip
        left = col in ("worker", "role", "health", "node", "device", "weights", "KV pool")
        table.add_column(col, justify="left" if left else "right", no_wrap=True)
    for w in st.workers:
        state = worker_state(w.state)
        style = _STATE_STYLE.get(w.state)
        table.add_row(
            w.worker_id,
            w.role,
            f"[{style}]{state}[/{style}]" if style else state,
            w.node[:8],
            device_column(w.device, w.tp_size, w.pp_size),
            _stored(
                w.quantization if w.quantization not in ("", "none") else w.weights_dtype,
                w.weight_bytes,
            ),
            _stored(w.kv_cache_dtype, w.kv_cache_bytes),
            f"{w.kv_blocks_used}/{w.kv_blocks_total}",
            str(w.inflight_requests),
            f"{w.queued_requests} ({w.queued_prefill_tokens} tok)",
            str(w.running_requests),
            f"{w.inflight_transfers} ({w.inflight_transfer_blocks} blk)",
            f"{w.ttft_p50_ms:.0f}/{w.ttft_p90_ms:.0f}",
            f"{w.tpot_p50_ms:.1f}/{w.tpot_p90_ms:.1f}",
            str(w.requests_done),
            f"{w.open_fds}/{w.threads}/{w.asyncio_tasks}",
        )
    t = st.thresholds
    table.caption = (
        f"router in-flight {st.router_inflight_requests} · admission: TTFT<= "
        f"{t.max_estimated_ttft_ms:.0f}ms queue<={t.max_queue_wait_ms:.0f}ms "
        f"in-flight<={t.max_inflight_requests} decode-KV<={t.max_decode_kv_utilization:.0%} "
        f"local-prefill<={t.local_prefill_threshold_tokens}tok"
    )
    return table


def split_lines(st: pb.ClusterStatus) -> list[str]:
    """One line per split worker: how its SMs are shared and what its hand-offs cost."""
    lines = []
    for w in st.workers:
        if not w.HasField("split"):
            continue
        s = w.split
        if s.partitioned:
            share = f"decode {s.decode_sms}/{s.total_sms} SMs, prefill {s.prefill_sms}"
            share += f" ({s.resizes} resizes)" if s.resizes else ""
            if s.decode_slowdown > 1.005:
                share += f", decode steps {s.decode_slowdown:.2f}x slower beside prefill"
        else:
            share = f"unpartitioned: {s.reason}"
        lines.append(
            f"split:    {w.worker_id}: {share} · {s.handoffs} hand-offs, "
            f"{s.handoff_us_mean:.0f} µs mean, {s.handoff_us_max:.0f} µs max"
        )
    return lines


def _stored(dtype: str, nbytes: int) -> str:
    """ "fp8 8.46 GiB": a dtype (e4m3 shown as fp8) and a byte count; "-" when not reported."""
    if not dtype:
        return "-"
    dtype = "fp8" if dtype == "float8_e4m3fn" else dtype
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{dtype} {nbytes / (1 << shift):.3g} {unit}"
    return f"{dtype} {nbytes} B"


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


# The lines of `limits_lines`: a label, then (RequestLimits field, how to show its value).
_LIMIT_LINES: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("limits", (
        ("max_model_len", "context <= {} tok"),
        ("max_prompt_tokens", "prompt <= {} tok"),
        ("max_concurrent_requests", "{} requests per router"),
        ("max_concurrent_streams", "{} streams per connection"),
        ("max_message_bytes", "messages <= {size}"),
        ("max_tenants", "{} tenants"),
    )),
    ("request", (
        ("max_stop_strings", "stop <= {} strings"),
        ("max_stop_string_chars", "stop string <= {} chars"),
        ("max_stop_token_ids", "stop token ids <= {}"),
        ("max_request_id_chars", "request id <= {} chars"),
        ("max_tenant_chars", "tenant <= {} chars"),
        ("max_cache_salt_chars", "cache salt <= {} chars"),
    )),
    ("timeouts", (
        ("default_request_timeout_s", "request {:g} s (when the client sets none)"),
        ("prefill_timeout_s", "prefill {:g} s"),
        ("handoff_timeout_s", "hand-off {:g} s"),
        ("token_gap_timeout_s", "between tokens {:g} s"),
    )),
)  # fmt: skip


def limits_lines(st: pb.ClusterStatus) -> list[str]:
    """The limits every request is checked against, a few lines for under the status table;
    none when the router sent none (fields it left at 0 are not shown)."""
    if not st.HasField("limits"):
        return []
    lines = []
    for label, items in _LIMIT_LINES:
        shown = []
        for name, fmt in items:
            value = getattr(st.limits, name)
            if value:
                shown.append(fmt.format(value, size=_size(int(value))))
        if shown:
            lines.append(f"{label + ':':10}{' · '.join(shown)}")
    return lines


def drain(
    target: Target | str,
    worker_id: str,
    stop: bool,
    timeout_s: float | None = None,
    force: bool = False,
) -> pb.DrainResponse:
    """Drain a worker; `timeout_s` None leaves the server's default (DRAIN_TIMEOUT_S)."""
    request = pb.DrainRequest(worker_id=worker_id, stop=stop, force=force)
    wait_s = _drain_timeout(request, timeout_s)
    with admin(target) as stub:
        return stub.Drain(request, timeout=wait_s + 30)


def _drain_timeout(request: pb.DrainRequest | pb.SwitchRequest, timeout_s: float | None) -> float:
    """Set the request's `timeout_s` (None: leave the server's default); how long its drain
    may take."""
    if timeout_s is not None:
        request.timeout_s = timeout_s
    return DRAIN_TIMEOUT_S if timeout_s is None else timeout_s


def undrain(target: Target | str, worker_id: str, timeout_s: float = 30.0) -> pb.UndrainResponse:
    with admin(target) as stub:
        return stub.Undrain(pb.UndrainRequest(worker_id=worker_id), timeout=timeout_s)


def rebalance(
    target: Target | str, prefill: int, decode: int, timeout_s: float, restart: bool = False
) -> pb.RebalanceResponse:
    request = pb.RebalanceRequest(
        prefill=prefill, decode=decode, timeout_s=timeout_s, restart=restart
    )
    with admin(target) as stub:
        return stub.Rebalance(request, timeout=timeout_s + 900)


def switch(
    target: Target | str,
    worker_id: str,
    role: str,
    timeout_s: float | None = None,
    force: bool = False,
) -> pb.SwitchResponse:
    """Switch a worker's role; `timeout_s` None leaves the server's default."""
    request = pb.SwitchRequest(worker_id=worker_id, role=role, force=force)
    wait_s = _drain_timeout(request, timeout_s)
    with admin(target) as stub:
        return stub.Switch(request, timeout=wait_s + 60)


def load_lora(target: Target | str, name: str, path: str, timeout_s: float) -> pb.LoraStatus:
    with admin(target) as stub:
        return stub.LoadLora(pb.LoadLoraRequest(name=name, path=path), timeout=timeout_s)


def unload_lora(target: Target | str, name: str, timeout_s: float) -> pb.LoraStatus:
    with admin(target) as stub:
        return stub.UnloadLora(pb.UnloadLoraRequest(name=name), timeout=timeout_s)


def list_loras(target: Target | str, timeout_s: float) -> pb.LoraStatus:
    with admin(target) as stub:
        return stub.ListLoras(pb.ListLorasRequest(), timeout=timeout_s)


def thresholds(
    target: Target | str, changes: dict[str, float], timeout_s: float = 10.0
) -> dict[str, float]:
    """Apply `changes` (may be empty) to a router's admission thresholds; returns them all.

    With several router replicas, each has its own thresholds: this talks to `target` only.
    """
    with admin(target) as stub:
        if changes:
            request = pb.AdmissionThresholds()
            for name, value in changes.items():
                setattr(request, name, value)
            reply = stub.SetThresholds(request, timeout=timeout_s)
        else:
            reply = stub.GetThresholds(pb.GetThresholdsRequest(), timeout=timeout_s)
    return {f.name: float(getattr(reply, f.name)) for f in reply.DESCRIPTOR.fields}
