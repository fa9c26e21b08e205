"""What `pdserve up` decides about who may reach a cluster, before anything starts.

- API keys (router/auth.py): from `cluster.api_keys_file`, else `$PDSERVE_API_KEYS`. With
  keys on, the CLI's admin key is `$PDSERVE_ADMIN_KEY` or one generated here; it goes into the
  state file (mode 0600) for the other commands, and into no log, argv or status line.
- Exposure: a router (gRPC, HTTP, admin plane) bound beyond loopback without keys is refused
  unless `cluster.insecure`, since anyone who reaches the port could generate, drain workers
  and rebalance. TLS files must be readable.
- The block hash (vocabulary/block_hash.py): `auto` is sha256 beyond loopback, xxh3 on it.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from deploy.control.config_tree import PdserveConfig
from router.auth import ADMIN_KEY_ENV, ApiKey, ApiKeyError, checked_digest, load_api_keys
from router.tls import TlsError
from vocabulary.block_hash import HashAlgorithm

ADMIN_TENANT = "admin"
"""The tenant of the CLI's admin key (its Generate calls, if any, are served as it)."""


class SecurityError(ValueError):
    """A setting `pdserve up` refuses (the message names the option and the fix)."""


@dataclass(frozen=True)
class Access:
    """The keys a cluster's routers accept, and the admin key the CLI uses ("" when auth is
    off)."""

    keys: tuple[ApiKey, ...] = ()
    admin_key: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def __repr__(self) -> str:  # never print a key
        return f"Access({len(self.keys)} keys, admin key {'set' if self.admin_key else 'none'})"


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1) or `localhost`."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve to anything


def cluster_access(config: PdserveConfig, env: Mapping[str, str] | None = None) -> Access:
    """The API keys of `config` (its file, else $PDSERVE_API_KEYS) plus the admin key
    ($PDSERVE_ADMIN_KEY, else generated when any key is set). SecurityError when they do not
    load."""
    environ = os.environ if env is None else env
    try:
        keys = load_api_keys(config.cluster.api_keys_file, dict(environ))
    except ApiKeyError as e:
        raise SecurityError(str(e)) from None
    admin_key = environ.get(ADMIN_KEY_ENV, "")
    if not keys and not admin_key:
        return Access()
    if not admin_key:
        admin_key = secrets.token_urlsafe(32)
    if admin_key.startswith("sha256:"):
        raise SecurityError(f"${ADMIN_KEY_ENV}: the key itself (the CLI sends it), not a digest")
    try:  # the same rules as a key in the file
        digest = checked_digest(admin_key, f"${ADMIN_KEY_ENV}")
    except ApiKeyError as e:
        raise SecurityError(str(e)) from None
    listed = next((k for k in keys if k.digest == digest), None)
    if listed is not None and not listed.admin:
        raise SecurityError(f"${ADMIN_KEY_ENV} is listed as a tenant key (of {listed.tenant!r})")
    if listed is None:
        keys = (*keys, ApiKey(digest, ADMIN_TENANT, admin=True))
    return Access(keys, admin_key)


def exposure_refusal(config: PdserveConfig, access: Access) -> str | None:
    """Why `pdserve up` must not start `config` as it is (None: it may)."""
    r = config.router
    try:
        r.tls.check_files()
    except TlsError as e:
        return f"--tls-{_TLS_FLAGS[str(e).split(':', 1)[0]]}: {str(e).split(': ', 1)[1]}"
    if access.enabled or config.cluster.insecure:
        return None
    for flag, host in (("--host", r.host), ("--admin-host", r.admin_host)):
        if not is_loopback(host):
            return (
                f"{flag} {host}: serving beyond loopback needs API keys (--api-keys-file FILE "
                "or $PDSERVE_API_KEYS; see docs/operations.md), or --insecure to serve without"
            )
    return None


_TLS_FLAGS = {"cert_file": "cert", "key_file": "key", "client_ca_file": "client-ca"}


def resolve_block_hash(config: PdserveConfig) -> HashAlgorithm:
    """`cluster.block_hash`, with auto resolved: sha256 when a router listens beyond
    loopback (a client there may craft colliding prefixes), xxh3 on loopback."""
    choice = config.cluster.block_hash
    if choice != "auto":
        return HashAlgorithm(choice)
    hosts = (config.router.host, config.router.admin_host)
    exposed = not all(is_loopback(h) for h in hosts)
    return HashAlgorithm.SHA256 if exposed else HashAlgorithm.XXH3
