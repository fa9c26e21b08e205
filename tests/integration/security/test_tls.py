"""TLS and mutual TLS on a real router (RouterServer in the test's loop, no workers needed
for a handshake): the gRPC data and admin planes and the HTTP API speak TLS with the
certificate made here; with a client CA, a client without a certificate, or with one of
another CA, is refused at the handshake, and one with a certificate of that CA is served.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from certs import Certs, Pem, make_certs
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc
from router.auth import ApiKey
from router.cluster_view import StaticDirectory
from router.router_server import RouterConfig, RouterServer
from router.tls import TlsConfig

T = TypeVar("T")
ADMIN_KEY = "admin-key-for-the-tls-tests-0123"
TENANT_KEY = "tenant-key-for-the-tls-tests-456"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _serve(model_dir: Path, tls: TlsConfig, body: Callable[[RouterServer], Awaitable[T]]) -> T:
    async def scenario() -> T:
        config = RouterConfig(
            model_dir=str(model_dir),
            grpc_port=0,
            http_port=0,
            tls=tls,
            api_keys=(ApiKey.of(ADMIN_KEY, "ops", admin=True), ApiKey.of(TENANT_KEY, "acme")),
        )
        server = RouterServer(config, StaticDirectory([]))
        await server.start()
        try:
            return await body(server)
        finally:
            await server.stop(0)

    return asyncio.run(scenario())


def _credentials(certs: Certs, client: Pem | None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=certs.ca.read_bytes(),
        private_key=client.key.read_bytes() if client else None,
        certificate_chain=client.cert.read_bytes() if client else None,
    )


async def _health(port: int, creds: grpc.ChannelCredentials | None) -> int:
    target = f"127.0.0.1:{port}"
    channel = grpc.aio.secure_channel(target, creds) if creds else grpc.aio.insecure_channel(target)
    async with channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
        return int(reply.status)


async def _status(port: int, creds: grpc.ChannelCredentials, key: str) -> pb.ClusterStatus:
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        return await pb_grpc.AdminStub(channel).Status(
            pb.StatusRequest(), metadata=(("authorization", f"Bearer {key}"),), timeout=5
        )


def _https(url: str, certs: Certs, client: Pem | None) -> int:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if client is not None:
        context.load_cert_chain(str(client.cert), str(client.key))
    try:
        with urllib.request.urlopen(url, context=context, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


async def _refused(call: Awaitable[object]) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    raise AssertionError("the call was served")


def test_tls_round_trip_on_both_grpc_planes_and_http(tiny_model_dir: Path, certs: Certs) -> None:
    tls = TlsConfig(str(certs.server.cert), str(certs.server.key))

    async def body(server: RouterServer) -> None:
        creds = _credentials(certs, None)
        assert await _health(server.port, creds) == health_pb2.HealthCheckResponse.NOT_SERVING
        status = await _status(server.admin_port, creds, ADMIN_KEY)
        assert status.http_url == f"https://127.0.0.1:{server.http_port}"
        # a tenant key over TLS is still a tenant key on the admin plane
        denied = await _refused(_status(server.admin_port, creds, TENANT_KEY))
        assert denied == grpc.StatusCode.PERMISSION_DENIED
        # plain TCP to a TLS port does not get an answer
        code = await _refused(_health(server.port, None))
        assert code == grpc.StatusCode.UNAVAILABLE
        url = f"https://127.0.0.1:{server.http_port}"
        assert await asyncio.to_thread(_https, url + "/health", certs, None) == 200
        assert await asyncio.to_thread(_https, url + "/v1/models", certs, None) == 401

    _serve(tiny_model_dir, tls, body)


def test_mutual_tls_serves_a_client_of_the_ca_and_refuses_others(
    tiny_model_dir: Path, certs: Certs
) -> None:
    tls = TlsConfig(str(certs.server.cert), str(certs.server.key), str(certs.ca))

    async def body(server: RouterServer) -> None:
        good = _credentials(certs, certs.client)
        assert await _health(server.port, good) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert (await _status(server.admin_port, good, ADMIN_KEY)).http_url.startswith("https")
        for client in (None, certs.rogue_client):
            creds = _credentials(certs, client)
            assert await _refused(_health(server.port, creds)) == grpc.StatusCode.UNAVAILABLE
            code = await _refused(_status(server.admin_port, creds, ADMIN_KEY))
            assert code == grpc.StatusCode.UNAVAILABLE
        url = f"https://127.0.0.1:{server.http_port}/v1/models"
        request = urllib.request.Request(url, headers={"authorization": f"Bearer {TENANT_KEY}"})
        context = ssl.create_default_context(cafile=str(certs.ca))
        context.load_cert_chain(str(certs.client.cert), str(certs.client.key))

        def models() -> dict[str, object]:
            with urllib.request.urlopen(request, context=context, timeout=5) as r:
                return dict(json.load(r))

        assert (await asyncio.to_thread(models))["object"] == "list"
        for client in (None, certs.rogue_client):
            with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
                await asyncio.to_thread(_https, url, certs, client)

    _serve(tiny_model_dir, tls, body)
