"""API keys: who calls, as which tenant, and whether they may use the admin plane.

A key is a bearer token: `authorization: Bearer KEY` in gRPC metadata, the `Authorization`
header over HTTP. Each key maps to a tenant (what admission limits and the prefix cache are
scoped by: the tenant comes from the key, never from the request) and may be an admin key.

    no keys configured    auth is off: every caller is served, the request's own tenant
                          field counts (loopback only, unless `pdserve up --insecure`)
    no / malformed key    UNAUTHENTICATED (HTTP 401), nothing executed
    unknown key           UNAUTHENTICATED (HTTP 401)
    tenant key on admin   PERMISSION_DENIED (HTTP 403)

The router holds only the SHA-256 of each key (`ApiKey.digest`), so neither its config nor its
memory holds a usable key, and a lookup is one digest and one dict probe (no comparison whose
time depends on how much of a guess was right). Keys never appear in a message or a log line.

The key file (`pdserve up --api-keys-file FILE`, or the same text in `$PDSERVE_API_KEYS`)
has one key per line, `KEY TENANT` or `KEY TENANT admin`; `#` starts a comment. A key is
16 to 256 printable characters without spaces or commas, or `sha256:` and the 64 hex digits of
one (a file that holds no usable key). In `$PDSERVE_API_KEYS` a comma also ends a line.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from router.validation import MAX_TENANT_CHARS, InvalidRequest, check_name

API_KEYS_ENV = "PDSERVE_API_KEYS"
"""Environment variable with the key file's text (read when no --api-keys-file is given)."""
ADMIN_KEY_ENV = "PDSERVE_ADMIN_KEY"
"""The admin key: `pdserve up` accepts it on the admin plane, the CLI sends it."""
CLIENT_KEY_ENV = "PDSERVE_API_KEY"
"""The key `pdserve generate` sends (default: the admin key of the cluster it started)."""
AUTH_HEADER = "authorization"
MIN_KEY_CHARS = 16
MAX_KEY_CHARS = 256
_KEY_RE = re.compile(r"[!-~]+")  # printable ASCII, no space
_DIGEST_RE = re.compile(r"sha256:([0-9a-f]{64})")
_WORKER_ID_RE = re.compile(r"\b(?:prefill|decode|colocated)-[0-9]+\b")
REDACTED_WORKER = "<worker>"


class ApiKeyError(ValueError):
    """A key file (or $PDSERVE_API_KEYS) that cannot be used; the message names the line
    (never the key)."""


def key_digest(key: str) -> str:
    """Hex SHA-256 of a key: what the router stores and looks up."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    """One key the router accepts, by its digest."""

    digest: str
    """Hex SHA-256 of the key (`key_digest`)."""
    tenant: str
    """The tenant its requests are served as."""
    admin: bool = False
    """May use the admin plane (and sees worker ids in its responses)."""

    @classmethod
    def of(cls, key: str, tenant: str, admin: bool = False) -> ApiKey:
        return cls(key_digest(key), tenant, admin)


@dataclass(frozen=True)
class Principal:
    """Who a call authenticated as."""

    tenant: str
    admin: bool


class AuthFailure(Exception):
    """A call refused before anything ran: its gRPC status and a message without the key."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return 403 if self.code is grpc.StatusCode.PERMISSION_DENIED else 401


class KeyTable:
    """The keys one router accepts; empty: auth is off."""

    def __init__(self, keys: Iterable[ApiKey] = ()) -> None:
        self._by_digest = {k.digest: Principal(k.tenant, k.admin) for k in keys}

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    def authenticate(self, authorization: str | None, *, admin: bool = False) -> Principal | None:
        """The caller an `authorization` value names; None when auth is off. Raises
        AuthFailure (UNAUTHENTICATED, or PERMISSION_DENIED for a tenant key where `admin`)."""
        if not self._by_digest:
            return None
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthFailure(
                grpc.StatusCode.UNAUTHENTICATED,
                "authorization: an API key is required (authorization: Bearer KEY)",
            )
        principal = self._by_digest.get(key_digest(key.strip()))
        if principal is None:
            raise AuthFailure(grpc.StatusCode.UNAUTHENTICATED, "authorization: unknown API key")
        if admin and not principal.admin:
            raise AuthFailure(
                grpc.StatusCode.PERMISSION_DENIED,
                "authorization: a tenant key may not use the admin plane (it needs an admin key)",
            )
        return principal

    def from_metadata(
        self, metadata: Sequence[tuple[str, str | bytes]] | None, *, admin: bool = False
    ) -> Principal | None:
        """`authenticate` with the `authorization` entry of gRPC invocation metadata."""
        value = next((v for k, v in metadata or () if k == AUTH_HEADER), None)
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        return self.authenticate(value, admin=admin)


def sees_workers(principal: Principal | None) -> bool:
    """Whether responses may name workers: with auth off (one trust domain) and for admins;
    a tenant must not learn where (or beside whom) its requests ran."""
    return principal is None or principal.admin


def redact_workers(message: str) -> str:
    """`message` with every worker id (`decode-3`) replaced, for a tenant's eyes."""
    return _WORKER_ID_RE.sub(REDACTED_WORKER, message)


# ---- the key file ---------------------------------------------------------------------------


def parse_api_keys(text: str, source: str) -> tuple[ApiKey, ...]:
    """The keys of a key file's `text` (see the module docstring); ApiKeyError naming
    `source:line` when a line does not fit."""
    keys: list[ApiKey] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        parts = line.split()
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "admin"):
            raise ApiKeyError(f"{where}: expected `KEY TENANT` or `KEY TENANT admin`")
        key, tenant = parts[0], parts[1]
        digest = checked_digest(key, where)
        try:
            check_name("tenant", tenant, MAX_TENANT_CHARS)
        except InvalidRequest as e:
            raise ApiKeyError(f"{where}: {e}") from None
        if digest in seen:
            raise ApiKeyError(f"{where}: the same key is listed twice")
        seen.add(digest)
        keys.append(ApiKey(digest, tenant, admin=len(parts) == 3))
    return tuple(keys)


def checked_digest(key: str, where: str) -> str:
    """The digest of `key` (or the one a `sha256:` key gives); ApiKeyError naming `where`
    when it is not a usable key."""
    given = _DIGEST_RE.fullmatch(key)
    if given is not None:
        return given.group(1)
    if key.startswith("sha256:"):
        raise ApiKeyError(f"{where}: a sha256: key needs 64 lowercase hex digits")
    if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS or not _KEY_RE.fullmatch(key):
        raise ApiKeyError(
            f"{where}: a key must be {MIN_KEY_CHARS} to {MAX_KEY_CHARS} printable characters "
            "without spaces or commas (`python -c 'import secrets; print(secrets.token_urlsafe"
            "(32))'` makes one)"
        )
    return key_digest(key)


def load_api_keys(path: str | None, env: dict[str, str] | None = None) -> tuple[ApiKey, ...]:
    """The keys of the key file at `path`, else of `$PDSERVE_API_KEYS` (commas end lines
    there too); () when neither is given."""
    environ = os.environ if env is None else env
    if path:
        try:
            text = Path(path).expanduser().read_text()
        except OSError as e:
            raise ApiKeyError(f"--api-keys-file: cannot read {path}: {e.strerror or e}") from e
        keys = parse_api_keys(text, path)
        if not keys:
            raise ApiKeyError(f"--api-keys-file: {path} holds no key")
        return keys
    text = environ.get(API_KEYS_ENV, "")
    return parse_api_keys(text.replace(",", "\n"), f"${API_KEYS_ENV}") if text else ()


# ---- gRPC -----------------------------------------------------------------------------------


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call without a valid key before its handler runs (on the admin plane,
    without an admin key). `open_methods` (the health service) need none."""

    def __init__(
        self, keys: KeyTable, *, admin: bool, open_methods: frozenset[str] = frozenset()
    ) -> None:
        self.keys = keys
        self.admin = admin
        self.open_methods = open_methods

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not self.keys.enabled:
            return handler
        if handler_call_details.method.rsplit("/", 1)[0] in self.open_methods:
            return handler
        try:
            metadata = handler_call_details.invocation_metadata
            self.keys.from_metadata(metadata, admin=self.admin)
        except AuthFailure as failure:
            return _refusal(handler, failure)
        return handler


def _refusal(handler: grpc.RpcMethodHandler, failure: AuthFailure) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only ends the call with `failure`."""

    async def unary(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(failure.code, failure.message)

    async def stream(
        request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[None]:
        await context.abort(failure.code, failure.message)
        yield  # never reached: abort raises

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)
