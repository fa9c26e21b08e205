"""API keys (router/auth.py): the key file's format and its refusals (naming the line, never
the key), authentication outcomes, and what a tenant's messages may say about workers."""

from __future__ import annotations

import grpc
import pytest

from router.auth import (
    ApiKey,
    ApiKeyError,
    AuthFailure,
    KeyTable,
    Principal,
    key_digest,
    load_api_keys,
    parse_api_keys,
    redact_workers,
    sees_workers,
)

KEY = "k" * 16
OTHER = "o" * 20


def test_key_file_lines_give_tenants_and_admins_by_digest() -> None:
    text = (
        f"# comment\n\n{KEY} acme  # trailing comment\n{OTHER} ops admin\n"
        f"sha256:{key_digest('z' * 32)} globex\n"
    )
    keys = parse_api_keys(text, "keys.txt")
    assert keys == (
        ApiKey(key_digest(KEY), "acme"),
        ApiKey(key_digest(OTHER), "ops", admin=True),
        ApiKey(key_digest("z" * 32), "globex"),
    )


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (f"{KEY}", "expected `KEY TENANT` or `KEY TENANT admin`"),
        (f"{KEY} acme root", "expected `KEY TENANT` or `KEY TENANT admin`"),
        ("short acme", "a key must be 16 to 256 printable characters"),
        ("sha256:abc acme", "a sha256: key needs 64 lowercase hex digits"),
        (f"{KEY} ac/me!", "tenant: character '!' is not allowed"),
        (f"{KEY} {'t' * 65}", "tenant: must be at most 64 characters"),
    ],
)
def test_a_bad_line_is_refused_naming_it_and_never_the_key(line: str, problem: str) -> None:
    with pytest.raises(ApiKeyError) as err:
        parse_api_keys(f"# first\n{line}\n", "keys.txt")
    assert str(err.value).startswith(f"keys.txt:2: {problem}"), str(err.value)
    assert KEY not in str(err.value)


def test_the_same_key_twice_is_refused() -> None:
    with pytest.raises(ApiKeyError, match=r"keys\.txt:2: the same key is listed twice"):
        parse_api_keys(f"{KEY} a\n{KEY} b\n", "keys.txt")


def test_keys_come_from_the_file_else_the_environment(tmp_path: object) -> None:
    env = {"PDSERVE_API_KEYS": f"{KEY} acme,{OTHER} ops admin"}
    assert [k.tenant for k in load_api_keys(None, env)] == ["acme", "ops"]
    assert load_api_keys(None, {}) == ()
    with pytest.raises(ApiKeyError, match="--api-keys-file: cannot read /nonexistent"):
        load_api_keys("/nonexistent", env)


def test_authentication_outcomes() -> None:
    table = KeyTable([ApiKey.of(KEY, "acme"), ApiKey.of(OTHER, "ops", admin=True)])
    assert table.authenticate(f"Bearer {KEY}") == Principal("acme", admin=False)
    assert table.authenticate(f"bearer  {OTHER} ", admin=True) == Principal("ops", admin=True)
    cases = [
        (None, False, grpc.StatusCode.UNAUTHENTICATED),
        ("", False, grpc.StatusCode.UNAUTHENTICATED),
        (KEY, False, grpc.StatusCode.UNAUTHENTICATED),  # no scheme
        (f"Basic {KEY}", False, grpc.StatusCode.UNAUTHENTICATED),
        ("Bearer not-a-key-of-this-table", False, grpc.StatusCode.UNAUTHENTICATED),
        (f"Bearer {KEY}", True, grpc.StatusCode.PERMISSION_DENIED),
    ]
    for header, admin, code in cases:
        with pytest.raises(AuthFailure) as err:
            table.authenticate(header, admin=admin)
        assert err.value.code is code, header
        assert KEY not in err.value.message and err.value.message.startswith("authorization: ")
    assert err.value.http_status == 403
    assert KeyTable().authenticate(None) is None  # auth off
    metadata = (("x-other", "1"), ("authorization", f"Bearer {KEY}"))
    assert table.from_metadata(metadata) == Principal("acme", admin=False)


def test_a_tenant_sees_no_worker_ids_an_admin_and_auth_off_do() -> None:
    message = "decode worker decode-12 left the cluster; prefill worker prefill-0: lost"
    assert redact_workers(message) == (
        "decode worker <worker> left the cluster; prefill worker <worker>: lost"
    )
    assert redact_workers("colocated-3 (12 tokens delivered)") == "<worker> (12 tokens delivered)"
    assert not sees_workers(Principal("acme", admin=False))
    assert sees_workers(Principal("ops", admin=True)) and sees_workers(None)
