"""TLS for the router's listeners (gRPC data and admin planes, the OpenAI HTTP API).

A certificate and its key turn TLS on for all of them; a client CA on top makes it mutual
(every client must present a certificate that CA signed, or the handshake fails). The files
are read by the router when it starts, on the node it runs on (routers are usually pinned to
the head node, `cluster.router_resources`); the config holds their paths, never their bytes.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


class TlsError(ValueError):
    """A TLS setting that cannot be used (the message names the field)."""


@dataclass(frozen=True)
class TlsConfig:
    """TLS of one router's listeners; no cert_file: plain TCP."""

    cert_file: str = ""
    """PEM certificate chain the router presents (its SAN must name the address clients use)."""
    key_file: str = ""
    """PEM private key of `cert_file`."""
    client_ca_file: str = ""
    """PEM CA bundle client certificates must chain to (mutual TLS); empty: no client
    certificate is asked for."""

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    def check_files(self) -> None:
        """TlsError naming the first field that is missing or whose file cannot be read."""
        if bool(self.cert_file) != bool(self.key_file):
            missing = "key_file" if self.cert_file else "cert_file"
            raise TlsError(f"{missing}: TLS needs both a certificate and its key")
        if self.client_ca_file and not self.cert_file:
            raise TlsError("client_ca_file: mutual TLS needs cert_file and key_file too")
        for name in ("cert_file", "key_file", "client_ca_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise TlsError(f"{name}: {path} is not a readable file")

    def grpc_credentials(self) -> grpc.ServerCredentials:
        self.check_files()
        key, cert = Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes()
        ca = Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )

    def uvicorn_options(self) -> dict[str, Any]:
        """The uvicorn.Config arguments of this TLS (empty when off)."""
        if not self.enabled:
            return {}
        self.check_files()
        options: dict[str, Any] = {"ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file}
        if self.client_ca_file:
            options |= {"ssl_ca_certs": self.client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        return options

    @property
    def scheme(self) -> str:
        return "https" if self.enabled else "http"
