"""Issue 23 on a real cluster (conftest.py: keys, TLS, SHA-256 block hashes, Redis with a
password, tenant limits): every call without a key, with a wrong key, or with a tenant key on
the admin plane gets its status and runs nothing; the tenant is the key's; a tenant's cache is
its own (the same prompt from another tenant gets no cached tokens) and its responses name no
worker; per-tenant limits hold while other tenants are served; no key or password reaches a
log or `pdserve status --json`; the embedded Redis refuses a client without its password."""

from __future__ import annotations

import json
import random
import re
import ssl
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from secure_harness import ADMIN_KEY, KEYS, SecureCluster, bearer

from pdserve.v1 import serving_pb2 as pb

pytestmark = pytest.mark.timeout(300)


def prompt(seed: int, n: int = 64) -> list[int]:
    """Token ids no other test sends (4 full blocks of 16 at the default n)."""
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def generate(sc: SecureCluster, key: str | None, **fields: Any) -> list[pb.GenerateResponse]:
    fields.setdefault("max_tokens", 2)
    fields.setdefault("temperature", 0.0)
    fields.setdefault("ignore_eos", True)
    with sc.channel() as channel:
        from pdserve.v1 import serving_pb2_grpc as pb_grpc

        stub = pb_grpc.GenerationStub(channel)
        metadata = bearer(key) if key is not None else None
        return list(stub.Generate(pb.GenerateRequest(**fields), metadata=metadata, timeout=60))


def refusal(fn: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    try:
        result = fn(*args, **kwargs)
        if hasattr(result, "__iter__"):
            list(result)
    except grpc.RpcError as e:
        return e
    raise AssertionError("the call was served")


def requests_total(sc: SecureCluster) -> float:
    """Requests the router counted (any outcome): an unauthenticated call is not one."""
    url = sc.cluster.endpoint.metrics[0]
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(
        float(line.rpartition(" ")[2])
        for line in body.splitlines()
        if line.startswith("pdserve_requests_total{")
    )


def https(
    sc: SecureCluster, path: str, body: dict[str, Any] | None = None, key: str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any], dict[str, str]]:  # fmt: skip
    request = urllib.request.Request(
        sc.http_url + path,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"content-type": "application/json", **(headers or {})},
    )
    if key is not None:
        request.add_header("authorization", f"Bearer {key}")
    context = ssl.create_default_context(cafile=str(sc.certs.ca))
    try:
        with urllib.request.urlopen(request, context=context, timeout=60) as r:
            return r.status, json.load(r), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e), dict(e.headers)


# ---- authentication -------------------------------------------------------------------------


@pytest.mark.parametrize("key", [None, "not-a-key-of-this-cluster-0000"], ids=["none", "wrong"])
def test_generate_without_a_valid_key_is_unauthenticated_and_runs_nothing(
    secure_cluster: SecureCluster, key: str | None
) -> None:
    before = requests_total(secure_cluster)
    err = refusal(generate, secure_cluster, key, token_ids=prompt(1))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
    assert err.details().startswith("authorization: ")
    assert requests_total(secure_cluster) == before
    # a malformed header is refused the same way
    with secure_cluster.channel() as channel:
        from pdserve.v1 import serving_pb2_grpc as pb_grpc

        call = pb_grpc.GenerationStub(channel).Generate
        req = pb.GenerateRequest(token_ids=prompt(1), max_tokens=1)
        err = refusal(call, req, metadata=(("authorization", KEYS["acme"]),), timeout=10)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_needs_no_key_and_reflection_does(secure_cluster: SecureCluster) -> None:
    with secure_cluster.channel() as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


ADMIN_CALLS = [
    ("Status", pb.StatusRequest()),
    ("GetThresholds", pb.GetThresholdsRequest()),
    ("SetThresholds", pb.AdmissionThresholds(max_inflight_requests=3)),
    ("Drain", pb.DrainRequest(worker_id="decode-1", stop=True, timeout_s=1)),
    ("Undrain", pb.UndrainRequest(worker_id="decode-1")),
    ("Rebalance", pb.RebalanceRequest(prefill=0, decode=1, timeout_s=1)),
]


@pytest.mark.parametrize(("method", "request_"), ADMIN_CALLS, ids=[m for m, _ in ADMIN_CALLS])
def test_every_admin_call_needs_the_admin_key_and_runs_nothing_without(
    secure_cluster: SecureCluster, method: str, request_: Any
) -> None:
    admin = secure_cluster.admin()
    before = admin.Status(pb.StatusRequest(), metadata=bearer(ADMIN_KEY), timeout=10)
    cases = [
        (None, grpc.StatusCode.UNAUTHENTICATED),
        (bearer("not-a-key-of-this-cluster-0000"), grpc.StatusCode.UNAUTHENTICATED),
        (bearer(KEYS["acme"]), grpc.StatusCode.PERMISSION_DENIED),
    ]
    for metadata, code in cases:
        err = refusal(getattr(admin, method), request_, metadata=metadata, timeout=30)
        assert err.code() == code, (metadata, err.details())
    after = admin.Status(pb.StatusRequest(), metadata=bearer(ADMIN_KEY), timeout=10)
    assert after.thresholds == before.thresholds  # SetThresholds changed nothing
    assert [(w.worker_id, w.state) for w in after.workers] == [
        (w.worker_id, w.state) for w in before.workers
    ]  # nothing drained, undrained or rebalanced


def test_the_admin_plane_is_not_on_the_data_port(secure_cluster: SecureCluster) -> None:
    with secure_cluster.channel() as channel:
        from pdserve.v1 import serving_pb2_grpc as pb_grpc

        err = refusal(
            pb_grpc.AdminStub(channel).Status, pb.StatusRequest(), metadata=bearer(ADMIN_KEY),
            timeout=10,
        )  # fmt: skip
        assert err.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize(
    ("key", "status", "code"),
    [(None, 401, "invalid_api_key"), ("not-a-key-of-this-cluster-0000", 401, "invalid_api_key")],
    ids=["none", "wrong"],
)
def test_http_without_a_valid_key_is_401_and_runs_nothing(
    secure_cluster: SecureCluster, key: str | None, status: int, code: str
) -> None:
    before = requests_total(secure_cluster)
    body = {"model": secure_cluster.model_id, "prompt": prompt(2), "max_tokens": 2}
    got, reply, headers = https(secure_cluster, "/v1/completions", body, key)
    assert (got, reply["error"]["code"], reply["error"]["param"]) == (401, code, "authorization")
    assert headers.get("www-authenticate", "").startswith("Bearer")
    assert https(secure_cluster, "/v1/models", key=key)[0] == 401
    assert requests_total(secure_cluster) == before
    assert https(secure_cluster, "/health")[0] == 200  # probes need no key
    assert https(secure_cluster, "/v1/models", key=KEYS["acme"])[0] == 200


# ---- tenants --------------------------------------------------------------------------------


def _cached(responses: list[pb.GenerateResponse]) -> int:
    return int(responses[-1].usage.cached_prompt_tokens)


def test_the_same_prompt_from_another_tenant_gets_no_cached_tokens(
    secure_cluster: SecureCluster,
) -> None:
    ids = prompt(3)
    first = generate(secure_cluster, KEYS["acme"], token_ids=ids)
    assert _cached(first) == 0
    again = generate(secure_cluster, KEYS["acme"], token_ids=ids)
    assert _cached(again) >= 48, again[-1].usage  # acme's own cache
    other = generate(secure_cluster, KEYS["globex"], token_ids=ids)
    assert _cached(other) == 0, other[-1].usage  # never acme's blocks
    assert _cached(generate(secure_cluster, KEYS["globex"], token_ids=ids)) >= 48
    # the same holds over HTTP: usage.prompt_tokens_details.cached_tokens
    body = {"model": secure_cluster.model_id, "prompt": ids, "max_tokens": 2}
    status, reply, _ = https(secure_cluster, "/v1/completions", body, KEYS["initech"])
    assert status == 200, reply
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_client_set_tenant_is_ignored_when_the_key_says_otherwise(
    secure_cluster: SecureCluster,
) -> None:
    ids = prompt(4)
    # acme claims to be globex: served as acme, so globex's cache stays empty
    generate(secure_cluster, KEYS["acme"], token_ids=ids, tenant="globex")
    assert _cached(generate(secure_cluster, KEYS["globex"], token_ids=ids)) == 0
    assert _cached(generate(secure_cluster, KEYS["acme"], token_ids=ids)) >= 48
    # over HTTP the tenant header is ignored the same way
    ids = prompt(5)
    body = {"model": secure_cluster.model_id, "prompt": ids, "max_tokens": 2}
    headers = {"x-pdserve-tenant": "globex"}
    assert https(secure_cluster, "/v1/completions", body, KEYS["acme"], headers)[0] == 200
    assert _cached(generate(secure_cluster, KEYS["globex"], token_ids=ids)) == 0


def test_a_tenant_sees_no_worker_ids_and_the_admin_does(secure_cluster: SecureCluster) -> None:
    tenant = generate(secure_cluster, KEYS["acme"], token_ids=prompt(6))[-1].timings
    assert (tenant.prefill_worker, tenant.decode_worker) == ("", "")
    assert tenant.ttft_ms > 0
    admin = generate(secure_cluster, ADMIN_KEY, token_ids=prompt(7))[-1].timings
    assert admin.prefill_worker.startswith("prefill-")
    assert admin.decode_worker.startswith("decode-")


def test_a_tenant_over_its_inflight_limit_is_refused_while_others_are_served(
    secure_cluster: SecureCluster,
) -> None:
    with secure_cluster.channel() as channel:
        from pdserve.v1 import serving_pb2_grpc as pb_grpc

        stub = pb_grpc.GenerationStub(channel)
        long = stub.Generate(
            pb.GenerateRequest(token_ids=prompt(8), max_tokens=400, ignore_eos=True),
            metadata=bearer(KEYS["limited"]),
            timeout=120,
        )
        first = next(long)  # admitted and streaming: limited's one request in flight
        assert first.token_ids
        got: dict[str, Any] = {}

        def other_tenant() -> None:
            got["acme"] = generate(secure_cluster, KEYS["acme"], token_ids=prompt(9))

        t = threading.Thread(target=other_tenant)
        t.start()
        try:
            err = refusal(generate, secure_cluster, KEYS["limited"], token_ids=prompt(10))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_inflight_requests 1" in err.details(), err.details()
            trailers = dict(err.trailing_metadata() or ())  # type: ignore[attr-defined]
            assert int(trailers["retry-after-ms"]) > 0
            body = {"model": secure_cluster.model_id, "prompt": prompt(11), "max_tokens": 2}
            status, reply, headers = https(secure_cluster, "/v1/completions", body,
                                           KEYS["limited"])  # fmt: skip
            assert status == 429 and "max_inflight_requests" in reply["error"]["message"]
            assert int(headers["retry-after"]) >= 1
        finally:
            t.join(60)
            long.cancel()
        assert got["acme"][-1].usage.completion_tokens == 2  # served meanwhile
    # once its stream is gone the tenant is served again
    deadline = time.monotonic() + 30
    while True:
        try:
            generate(secure_cluster, KEYS["limited"], token_ids=prompt(12))
            break
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_tenant_over_its_token_rate_is_refused_naming_the_limit(
    secure_cluster: SecureCluster,
) -> None:
    # 60 prompt + 20 max tokens = 80 of the bucket's 100 tokens (only this test spends them);
    # the next 80 do not fit
    generate(secure_cluster, KEYS["slow"], token_ids=prompt(13, 60), max_tokens=20)
    err = refusal(generate, secure_cluster, KEYS["slow"], token_ids=prompt(14, 60), max_tokens=20)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tokens_per_s 0.5" in err.details() and "'slow'" in err.details(), err.details()
    trailers = dict(err.trailing_metadata() or ())  # type: ignore[attr-defined]
    assert int(trailers["retry-after-ms"]) > 1000
    assert generate(secure_cluster, KEYS["globex"], token_ids=prompt(15))[-1].usage  # others go


# ---- secrets and the index ------------------------------------------------------------------


def _secrets(sc: SecureCluster) -> list[str]:
    password = re.match(r"redis://:([^@]+)@", sc.redis_url)
    assert password is not None, "the embedded Redis has a password"
    return [*KEYS.values(), ADMIN_KEY, password.group(1)]


def test_keys_and_the_redis_password_appear_in_no_status_and_no_log(
    secure_cluster: SecureCluster, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from deploy.cli.app import app

    env = {
        "PDSERVE_ADMIN_KEY": ADMIN_KEY,
        "PDSERVE_TLS_CA": str(secure_cluster.certs.ca),
        "PDSERVE_STATE_FILE": str(tmp_path / "none.json"),
    }
    shown = CliRunner().invoke(
        app, ["status", "--json", "--target", secure_cluster.admin_target], env=env
    )
    assert shown.exit_code == 0, shown.output
    # (the JSON; a line an actor of this test process's Ray logs meanwhile may follow it)
    status, _ = json.JSONDecoder().raw_decode(shown.output)
    assert {w["role"] for w in status["workers"]} == {"prefill", "decode"}
    table = CliRunner().invoke(app, ["status", "--target", secure_cluster.admin_target], env=env)
    assert table.exit_code == 0, table.output
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    texts = [shown.output, table.output]
    texts += [p.read_text(errors="replace") for p in logs.rglob("*") if p.is_file()]
    for secret in _secrets(secure_cluster):
        assert not any(secret in text for text in texts)


def test_the_embedded_redis_refuses_a_client_without_its_password(
    secure_cluster: SecureCluster,
) -> None:
    import redis

    server = secure_cluster.cluster.redis
    assert server is not None
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=server.host, port=server.port, socket_timeout=5).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=server.host, port=server.port, password="guess", socket_timeout=5).ping()
    assert redis.Redis.from_url(secure_cluster.redis_url, socket_timeout=5).ping()


def test_index_keys_are_sha256_block_hashes(secure_cluster: SecureCluster) -> None:
    import redis

    generate(secure_cluster, KEYS["acme"], token_ids=prompt(16))
    client = redis.Redis.from_url(secure_cluster.redis_url, socket_timeout=5)
    prefix = f"security-tests:{secure_cluster.model_id}:blk:"
    deadline = time.monotonic() + 10
    keys: list[bytes] = []
    while not keys and time.monotonic() < deadline:  # published by the workers' KV events
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        time.sleep(0.1)
    assert keys
    assert {len(k.decode()) - len(prefix) for k in keys} == {64}
