"""Assemble and run one router: the gRPC data plane (Generation, health, reflection), the
gRPC admin plane on its own port (Admin, health, reflection; loopback by default), the
OpenAI-compatible HTTP API (router/http, on the same event loop and orchestrator), cluster
view, admission controller, prefix index client and Prometheus metrics.

With API keys (`RouterConfig.api_keys`, router/auth.py) every call but health checks needs a
key, the admin plane an admin key; with `tls` every listener but metrics speaks TLS.

`RouterServer` runs in any asyncio loop (tests run it in-process); `RouterActor` hosts it in
a Ray actor so routers live with the cluster and several replicas can serve at once (each on
its own port, each with its own admission controller).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from admission.config import AdmissionConfig
from admission.controller import AdmissionController
from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc
from prefix_index.config import PrefixIndexConfig
from prefix_index.index import PrefixIndex
from router import validation
from router.auth import ApiKey, AuthInterceptor, KeyTable
from router.cluster_view import (
    ClusterView,
    ClusterViewConfig,
    ControllerDirectory,
    WorkerDirectory,
)
from router.control import ClusterControl, DrainReport, LoraEntry, RebalanceReport
from router.metrics import Arrivals, RecentSamples, RouterMetrics, SloTargets
from router.orchestrator import Orchestrator, OrchestratorConfig
from router.prefill_cost import LocalPrefillPolicy
from router.servicer import AdminServicer, GenerationServicer, generation_handler
from router.tls import TlsConfig
from router.validation import ValidationLimits
from vocabulary import tracing
from vocabulary.block_hash import set_algorithm
from vocabulary.malloc_trim import start_malloc_trim
from vocabulary.model_config import ModelConfig
from vocabulary.sampling import MAX_STRUCTURED_SPEC_CHARS
from vocabulary.tokenizer import Tokenizer
from vocabulary.worker_api import RoleSwitch, WorkerRole

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from router.http import HttpServer

log = logging.getLogger(__name__)

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["Admin"].full_name
_OPEN_SERVICES = frozenset({f"/{health.SERVICE_NAME}"})
"""Needs no API key: load balancers and orchestrators probe health without one."""


@dataclass(frozen=True)
class RouterPorts:
    """Where one started router listens (None: that listener is off)."""

    grpc: int
    admin: int
    metrics: int | None
    http: int | None


@dataclass(frozen=True)
class RouterSignals:
    """What the controller's planner reads from one router each tick."""

    samples: RecentSamples
    """TTFT/TPOT samples since the time asked for."""
    queued_requests: int
    """Requests waiting in this router's admission queue."""
    inflight_requests: int
    """Requests inside this router (queued, admitted or streaming)."""
    arrived: Arrivals = field(default_factory=Arrivals)
    """Requests received since the router started (the predictive planner's arrival rate)."""


@dataclass(frozen=True)
class RouterLimits:
    """What one router takes at once, checked before a request is validated."""

    max_message_bytes: int = 8 << 20
    """Largest gRPC message accepted (a prompt of 128k tokens of text fits); larger ones are
    refused by gRPC with RESOURCE_EXHAUSTED before they are parsed."""
    max_concurrent_requests: int = 4096
    """Requests this router holds at once (queued, admitted or streaming); one more gets
    RESOURCE_EXHAUSTED with retry-after before it is validated."""
    max_concurrent_streams: int = 1024
    """HTTP/2 streams per client connection (gRPC's `max_concurrent_streams`)."""
    max_structured_chars: int = MAX_STRUCTURED_SPEC_CHARS
    """Longest structured-output constraint a request may carry (a JSON schema's text, a
    regex, a grammar, a choice list's characters); at most 65536. How long one may take to
    compile is the workers' `grammar_compile_timeout_s`."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_structured_chars <= MAX_STRUCTURED_SPEC_CHARS:
            raise ValueError(
                f"max_structured_chars: must be in [1, {MAX_STRUCTURED_SPEC_CHARS}], "
                f"got {self.max_structured_chars}"
            )


@dataclass(frozen=True)
class RouterConfig:
    """Settings of one router replica. In a cluster's config tree (deploy/control/config_tree.py)
    this is the `router:` section; `Cluster` fills in the model, Redis, index and, per replica, the
    ports."""

    model_dir: str = ""
    """Checkpoint folder (the router reads config.json and tokenizer.json only)."""
    slo: SloTargets = field(default_factory=SloTargets)
    """Latency targets `pdserve_goodput_requests_total` counts against (`pdserve up` gives
    the planner's, `workers.planner.config`)."""
    model_id: str = ""
    """Binds prefix-cache hashes; must equal the workers' (defaults to the folder name)."""
    host: str = "127.0.0.1"
    """Address the gRPC, HTTP and metrics servers bind (0.0.0.0: every interface)."""
    grpc_port: int = 50051
    """gRPC port; 0 picks a free one."""
    admin_host: str = "127.0.0.1"
    """Address the admin plane (the Admin service: status, thresholds, drain, rebalance)
    binds; keep it on loopback unless API keys (with an admin key) are on."""
    admin_port: int = 0
    """Admin plane gRPC port; 0 picks a free one."""
    metrics_port: int | None = None
    """Prometheus HTTP port; None disables, 0 picks a free one."""
    http_port: int | None = None
    """OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /ready); None disables, 0 picks a free one."""
    redis_url: str | None = None
    """Prefix-index Redis; None routes on load alone."""
    index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)
    """Prefix-index lookups (timeouts, back-off after a failed lookup)."""
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    """Admission thresholds, policy tuning and tenant limits."""
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    """Placement weights, retries and stage deadlines of each request."""
    view: ClusterViewConfig = field(default_factory=ClusterViewConfig)
    """How often worker loads and the worker list are polled."""
    limits: RouterLimits = field(default_factory=RouterLimits)
    """Message size and concurrency limits."""
    tenants: tuple[str, ...] = ()
    """Known tenants (checked with API keys off); empty accepts any tenant name."""
    api_keys: tuple[ApiKey, ...] = ()
    """Accepted API keys, by digest (router/auth.py); empty: auth off. `pdserve up` fills
    them in from --api-keys-file / $PDSERVE_API_KEYS and the admin key."""
    tls: TlsConfig = field(default_factory=TlsConfig)
    """TLS (and mutual TLS) of the gRPC and HTTP listeners."""
    block_hash: str = ""
    """Block-hash algorithm of the cluster (xxh3 or sha256, vocabulary/block_hash.py); it must be
    the workers'. Empty: the process's own ($PDSERVE_BLOCK_HASH). Filled in by `pdserve up`."""

    @property
    def resolved_model_id(self) -> str:
        return self.model_id or Path(self.model_dir).name


class RouterServer:
    def __init__(
        self,
        config: RouterConfig,
        directory: WorkerDirectory,
        control: ClusterControl | None = None,
    ) -> None:
        self.config = config
        if config.block_hash:
            set_algorithm(config.block_hash)
        self.keys = KeyTable(config.api_keys)
        self.metrics = RouterMetrics(config.slo)
        self.view = ClusterView(directory, self.metrics, config.view)
        self.admission = AdmissionController(config.admission)
        self.index = (
            PrefixIndex(config.redis_url, config.resolved_model_id, config.index)
            if config.redis_url
            else None
        )
        if self.index is not None:
            self.metrics.watch_index(self.index)
        self.orchestrator = Orchestrator(
            self.view,
            self.admission,
            self.index,
            config.resolved_model_id,
            config.orchestrator,
            self.metrics,
        )
        local = config.orchestrator.local_prefill
        if local.kind is LocalPrefillPolicy.COST and local.cost is None:
            log.warning("local_prefill: policy cost without a profile; the threshold decides")
        model = ModelConfig.from_pretrained(config.model_dir)
        self.tokenizer = Tokenizer.from_model_dir(config.model_dir)
        self.model_max_len = model.max_model_len
        self.limits = ValidationLimits(
            max_model_len=model.max_model_len,
            vocab_size=model.vocab_size,
            tenants=frozenset(config.tenants),
            max_structured_chars=config.limits.max_structured_chars,
        )
        self.health = health.aio.HealthServicer()
        self.control = control
        self.server: grpc.aio.Server | None = None
        self.admin_server: grpc.aio.Server | None = None
        self.generation: GenerationServicer | None = None
        self.port = 0
        self.admin_port = 0
        self.metrics_port: int | None = None
        self.http: HttpServer | None = None
        self.http_port: int | None = None
        self._metrics_http: WSGIServer | None = None
        self._health_task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Start serving; returns the bound gRPC port."""
        tracing.configure_tracing("router")  # from OTEL_*: off unless an exporter is named
        start_malloc_trim("router")  # from PDSERVE_MALLOC_TRIM_S (cluster.malloc_trim_s)
        await self.view.start()
        self._update_limits()
        opts = [
            ("grpc.max_receive_message_length", self.config.limits.max_message_bytes),
            ("grpc.max_send_message_length", self.config.limits.max_message_bytes),
            ("grpc.max_concurrent_streams", self.config.limits.max_concurrent_streams),
            ("grpc.so_reuseport", 0),
        ]
        data = AuthInterceptor(self.keys, admin=False, open_methods=_OPEN_SERVICES)
        server = grpc.aio.server(options=opts, interceptors=(data,))
        self.generation = GenerationServicer(
            self.orchestrator,
            self.tokenizer,
            self.limits,
            self.config.limits.max_concurrent_requests,
            self.keys,
        )
        server.add_generic_rpc_handlers((generation_handler(self.generation),))
        self.port = self._listen(
            server, GENERATION_SERVICE, self.config.host, self.config.grpc_port
        )
        admin_plane = AuthInterceptor(self.keys, admin=True, open_methods=_OPEN_SERVICES)
        admin_server = grpc.aio.server(options=opts, interceptors=(admin_plane,))
        admin = AdminServicer(
            self.view,
            self.admission,
            self.orchestrator,
            self.metrics,
            self.control,
            self.config.resolved_model_id,
            self.request_limits,
            lambda: self.http_url,
            lambda: self.grpc_target,
        )
        pb_grpc.add_AdminServicer_to_server(admin, admin_server)
        self.admin_port = self._listen(
            admin_server, ADMIN_SERVICE, self.config.admin_host, self.config.admin_port
        )
        await server.start()
        self.server = server
        try:
            await admin_server.start()
        except BaseException:
            await server.stop(0)
            raise
        self.admin_server = admin_server
        if self.config.http_port is not None:
            try:
                await self._start_http(self.config.http_port)
            except BaseException:
                await server.stop(0)
                await admin_server.stop(0)
                raise
        if self.config.metrics_port is not None:
            self._metrics_http = _serve_metrics(
                self.metrics, self.config.host, self.config.metrics_port
            )
            self.metrics_port = int(self._metrics_http.server_port)
        await self._update_health()
        self._health_task = asyncio.create_task(self._health_loop())
        return self.port

    def _listen(self, server: grpc.aio.Server, service: str, host: str, port: int) -> int:
        """Health and reflection beside `service` on `server`, bound to host:port (TLS when
        configured); returns the bound port."""
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (service, health.SERVICE_NAME, reflection.SERVICE_NAME),
            server,
            pool=_ReflectionPool(descriptor_pool.Default()),
        )
        address = f"{host}:{port}"
        tls = self.config.tls
        bound = (
            server.add_secure_port(address, tls.grpc_credentials())
            if tls.enabled
            else server.add_insecure_port(address)
        )
        if bound == 0:
            raise OSError(f"cannot bind gRPC to {address}")
        return int(bound)

    async def _start_http(self, port: int) -> None:
        """The OpenAI door: its chat template read from the checkpoint (transformers is
        imported only when the door is on), then uvicorn on this loop."""
        from router.http import ChatTemplate, HttpServer, OpenAIDoor, Translator

        template = await asyncio.to_thread(ChatTemplate.from_model_dir, self.config.model_dir)
        translator = Translator(
            self.config.resolved_model_id,
            self.tokenizer,
            template,
            lambda: self.limits,
            self.view.lora_names,
        )
        limits = self.config.limits
        door = OpenAIDoor(
            self.orchestrator,
            translator,
            self.view,
            limits.max_concurrent_requests,
            limits.max_message_bytes,
            self.keys,
        )
        self.http = HttpServer(door.app(), self.config.host, port, tls=self.config.tls)
        self.http_port = await self.http.start()

    @property
    def grpc_target(self) -> str:
        """HOST:PORT of the gRPC data plane ("" before it listens)."""
        if not self.port:
            return ""
        host = self.config.host
        return f"{f'[{host}]' if ':' in host else host}:{self.port}"

    @property
    def http_url(self) -> str:
        """Base URL of the OpenAI API (`http(s)://host:port`; "" when it is off)."""
        if self.http_port is None:
            return ""
        host = self.config.host
        scheme = self.config.tls.scheme
        return f"{scheme}://{f'[{host}]' if ':' in host else host}:{self.http_port}"

    def _update_limits(self) -> None:
        """Workers may serve a shorter context than the model (engine max_model_len); the
        limit follows the registry, so workers that join after start count too."""
        infos = [e.info for e in self.view.entries.values()]
        if infos:
            decode_pools = [
                i.num_kv_blocks * i.block_size for i in infos if i.role is not WorkerRole.PREFILL
            ]
            self.limits = ValidationLimits(
                max_model_len=min(self.model_max_len, *(i.max_model_len for i in infos)),
                vocab_size=self.limits.vocab_size,
                tenants=self.limits.tenants,
                max_structured_chars=self.limits.max_structured_chars,
                # every role may compute a prompt (decode workers prefill short ones)
                max_prompt_tokens=min(i.num_kv_blocks * i.block_size for i in infos),
                max_sequence_tokens=min(decode_pools) if decode_pools else None,
            )
            if self.generation is not None:
                self.generation.limits = self.limits

    def request_limits(self) -> pb.RequestLimits:
        """Every limit a request is checked against, as `pdserve status` shows them."""
        o, lim = self.config.orchestrator, self.limits
        return pb.RequestLimits(
            max_request_id_chars=validation.MAX_REQUEST_ID_CHARS,
            max_tenant_chars=validation.MAX_TENANT_CHARS,
            max_cache_salt_chars=validation.MAX_CACHE_SALT_CHARS,
            max_stop_strings=validation.MAX_STOP_STRINGS,
            max_stop_string_chars=validation.MAX_STOP_STRING_CHARS,
            max_stop_token_ids=validation.MAX_STOP_TOKEN_IDS,
            max_message_bytes=self.config.limits.max_message_bytes,
            max_concurrent_requests=self.config.limits.max_concurrent_requests,
            max_concurrent_streams=self.config.limits.max_concurrent_streams,
            max_model_len=lim.max_model_len,
            max_prompt_tokens=lim.max_prompt_tokens or 0,
            default_request_timeout_s=o.default_request_timeout_s,
            prefill_timeout_s=o.prefill_timeout_s,
            handoff_timeout_s=o.handoff_timeout_s,
            token_gap_timeout_s=o.token_gap_timeout_s,
            max_tenants=self.config.admission.max_tracked_tenants,
        )

    async def _update_health(self) -> None:
        serving = bool(self.view.decode_workers())
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", GENERATION_SERVICE):
            await self.health.set(name, status)
        await self.health.set(ADMIN_SERVICE, health_pb2.HealthCheckResponse.SERVING)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            try:
                self._update_limits()
                await self._update_health()
            except Exception:
                log.exception("health update failed")

    async def wait_ready(self, min_decode: int = 1, timeout_s: float = 60.0) -> None:
        """Return once `min_decode` decode-capable workers are serving."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while len(self.view.decode_workers()) < min_decode:
            if loop.time() > end:
                raise TimeoutError(f"fewer than {min_decode} decode workers after {timeout_s}s")
            await self.view.refresh_registry()
            await self.view.poll_loads()
            await asyncio.sleep(0.05)
        self._update_limits()

    def signals(self, since_s: float) -> RouterSignals:
        """Latency samples since wall-clock `since_s` and queue depth, for the planner."""
        return RouterSignals(
            samples=self.metrics.recent_samples(since_s),
            queued_requests=self.admission.stats().waiting_now,
            inflight_requests=self.orchestrator.inflight,
            arrived=self.orchestrator.arrived,
        )

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.http is not None:
            await self.http.stop()
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.admin_server is not None:
            await self.admin_server.stop(grace_s)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None
        await self.view.stop()
        if self.index is not None:
            self.index.close()


class _ReflectionPool:
    """The descriptor pool for server reflection, plus method symbols.

    `grpcurl describe pdserve.v1.Generation.Generate` asks for the file containing a method
    symbol; protobuf's upb pool finds services and messages but not methods. This falls back
    to the method's service. Everything else goes to the wrapped pool.
    """

    def __init__(self, pool: descriptor_pool.DescriptorPool) -> None:
        self._pool = pool

    def FindFileContainingSymbol(self, symbol: str) -> Any:
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            service, _, method = symbol.rpartition(".")
            try:
                found = self._pool.FindServiceByName(service)
            except KeyError:
                found = None
            if found is None or method not in found.methods_by_name:
                raise
            return found.file

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


def _serve_metrics(metrics: RouterMetrics, host: str, port: int) -> WSGIServer:
    """Prometheus HTTP endpoint on the router's own host (0.0.0.0 behind a Service)."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server


class ControllerControl:
    """ClusterControl over the controller actor."""

    def __init__(self, controller: Any) -> None:
        self.controller = controller

    async def drain(self, worker_id: str, stop: bool, timeout_s: float, force: bool) -> DrainReport:
        report: DrainReport = await self.controller.drain.remote(worker_id, stop, timeout_s, force)
        return report

    async def undrain(self, worker_id: str) -> str:
        return str(await self.controller.undrain.remote(worker_id))

    async def rebalance(
        self, prefill: int, decode: int, timeout_s: float, restart: bool = False
    ) -> RebalanceReport:
        report: RebalanceReport = await self.controller.rebalance.remote(
            prefill, decode, timeout_s, restart
        )
        return report

    async def switch(
        self, worker_id: str, role: str, timeout_s: float, force: bool = False
    ) -> RoleSwitch:
        done: RoleSwitch = await self.controller.switch.remote(worker_id, role, timeout_s, force)
        return done

    async def load_lora(self, name: str, path: str) -> list[LoraEntry]:
        return list(await self.controller.load_lora.remote(name, path))

    async def unload_lora(self, name: str) -> list[LoraEntry]:
        return list(await self.controller.unload_lora.remote(name))

    async def list_loras(self) -> list[LoraEntry]:
        return list(await self.controller.list_loras.remote())


class RouterActor:
    """Ray actor hosting one RouterServer (wrap with `ray.remote`)."""

    def __init__(self, config: RouterConfig, controller_name: str, namespace: str) -> None:
        self.config = config
        self.controller_name = controller_name
        self.namespace = namespace
        self.server: RouterServer | None = None

    async def start(self, min_decode: int = 1, timeout_s: float = 600.0) -> RouterPorts:
        """Serve; returns where it listens once `min_decode` workers are ready."""
        import ray

        controller = ray.get_actor(self.controller_name, namespace=self.namespace)
        self.server = RouterServer(
            self.config, ControllerDirectory(controller), ControllerControl(controller)
        )
        port = await self.server.start()
        await self.server.wait_ready(min_decode, timeout_s)
        s = self.server
        return RouterPorts(port, s.admin_port, s.metrics_port, s.http_port)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()
        await asyncio.to_thread(tracing.shutdown_tracing)  # what is left goes to the exporter

    def finished_spans(self, clear: bool = False) -> list[tracing.FinishedSpan]:
        """The spans this router exported to the `pdserve_memory` exporter (tests and
        debugging; empty with another exporter or tracing off)."""
        return tracing.finished_spans(clear)

    def pause_tracing(self, paused: bool) -> bool:
        """Stop opening spans (or open them again), keeping the exporters; True when this
        router traces now. Its requests then carry no context to the workers either."""
        return tracing.pause_tracing(paused)

    def signals(self, since_s: float) -> RouterSignals | None:
        """The planner's input from this router (None before it serves)."""
        return self.server.signals(since_s) if self.server is not None else None

    def ping(self) -> str:
        return "ok"
