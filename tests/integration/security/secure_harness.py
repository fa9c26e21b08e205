"""The secure cluster of these tests (conftest.py starts it) and its keys."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from certs import Certs

from pdserve.v1 import serving_pb2_grpc as pb_grpc

KEYS = {
    "acme": "acme-key-0123456789abcdef",
    "globex": "globex-key-0123456789abcdef",
    "limited": "limited-key-0123456789abcdef",
    "slow": "slow-key-0123456789abcdef0",
    "initech": "initech-key-0123456789abcdef",
}
ADMIN_KEY = "the-admin-key-0123456789abcdef"
SLOW_BURST_TOKENS = 100.0


@dataclass
class SecureCluster:
    cluster: Any  # deploy.control.launch.Cluster
    certs: Certs
    target: str
    admin_target: str
    http_url: str
    redis_url: str
    model_id: str
    keys_file: Path

    def channel(self, admin: bool = False) -> grpc.Channel:
        creds = grpc.ssl_channel_credentials(root_certificates=self.certs.ca.read_bytes())
        return grpc.secure_channel(self.admin_target if admin else self.target, creds)

    def generation(self) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(self.channel())

    def admin(self) -> pb_grpc.AdminStub:
        return pb_grpc.AdminStub(self.channel(admin=True))


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)
