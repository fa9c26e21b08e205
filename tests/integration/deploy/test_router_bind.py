"""On a multi-node cluster routers listen on `host` (e.g. 0.0.0.0 behind a Kubernetes Service):
the gRPC API and the Prometheus metrics must both answer on a non-loopback address.
"""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from pathlib import Path

import grpc
import pytest

from router.cluster_view import StaticDirectory
from router.router_server import RouterConfig, RouterServer


def non_loopback_ip() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: picks the outgoing interface
            ip = str(s.getsockname()[0])
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


IP = non_loopback_ip()
pytestmark = pytest.mark.skipif(IP is None, reason="no non-loopback IPv4 address here")


def serve_and_probe(model_dir: Path) -> tuple[bool, bool]:
    """(gRPC answers on IP, metrics answer on IP) for a router configured with host 0.0.0.0."""

    async def run() -> tuple[bool, bool]:
        config = RouterConfig(model_dir=str(model_dir), host="0.0.0.0", grpc_port=0, metrics_port=0)
        server = RouterServer(config, StaticDirectory([]))
        port = await server.start()
        try:
            grpc_ok = await asyncio.to_thread(_grpc_ready, f"{IP}:{port}")
            metrics_ok = await asyncio.to_thread(_http_ok, f"http://{IP}:{server.metrics_port}/")
        finally:
            await server.stop(0)
        return grpc_ok, metrics_ok

    return asyncio.run(run())


def _grpc_ready(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=5)
            return True
        except grpc.FutureTimeoutError:
            return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def test_router_grpc_listens_on_its_configured_host(tiny_model_dir: Path) -> None:
    grpc_ok, _ = serve_and_probe(tiny_model_dir)
    assert grpc_ok


def test_router_metrics_listen_on_its_configured_host(tiny_model_dir: Path) -> None:
    _, metrics_ok = serve_and_probe(tiny_model_dir)
    assert metrics_ok
