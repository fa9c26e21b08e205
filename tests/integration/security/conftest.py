"""One real cluster with everything issue 23 turns on: API keys from a key file (tenants acme,
globex, limited, slow) and an admin key from $PDSERVE_ADMIN_KEY, TLS on the gRPC planes and
the HTTP API with a certificate made here, SHA-256 block hashes, the embedded Redis with its
generated password, and per-tenant limits; 1 prefill + 1 decode worker on the session's Ray.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from certs import make_certs
from cpu_engine import cpu_engine
from directory_scope import stop_with_directory
from secure_harness import ADMIN_KEY, KEYS, SLOW_BURST_TOKENS, SecureCluster, bearer

from admission.config import AdmissionConfig, AdmissionThresholds, TenantLimit


@pytest.fixture(scope="session")
def secure_cluster(
    request: pytest.FixtureRequest,
    ray_cluster: None,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SecureCluster]:
    from deploy.control.cluster_spec import ClusterSpec
    from deploy.control.config_tree import LaunchConfig, PdserveConfig
    from deploy.control.launch import Cluster
    from router.router_server import RouterConfig
    from router.tls import TlsConfig

    folder = tmp_path_factory.mktemp("secure")
    certs = make_certs(folder)
    keys_file = folder / "api-keys"
    keys_file.write_text(
        "# tenant keys\n" + "".join(f"{key} {tenant}\n" for tenant, key in KEYS.items())
    )
    engine = cpu_engine(tiny_model_dir, num_kv_blocks=256, max_model_len=1024)
    limits = (
        TenantLimit("limited", max_inflight_requests=1),
        TenantLimit("slow", tokens_per_s=0.5, burst_tokens=SLOW_BURST_TOKENS),
    )
    router = RouterConfig(
        grpc_port=0,
        admin_port=0,
        metrics_port=0,
        http_port=0,
        tls=TlsConfig(str(certs.server.cert), str(certs.server.key)),
        admission=AdmissionConfig(
            thresholds=AdmissionThresholds(local_prefill_threshold_tokens=0), tenant_limits=limits
        ),
    )
    config = PdserveConfig(
        model=str(tiny_model_dir),
        cluster=LaunchConfig(
            name="security-tests", api_keys_file=str(keys_file), block_hash="sha256"
        ),
        router=router,
        workers=ClusterSpec(engine=engine, num_prefill=1, num_decode=1),
    )
    before = os.environ.get("PDSERVE_ADMIN_KEY")
    os.environ["PDSERVE_ADMIN_KEY"] = ADMIN_KEY
    try:
        cluster = Cluster(config)
        stop_with_directory(request, cluster.stop)
        cluster.start()
    finally:
        if before is None:
            del os.environ["PDSERVE_ADMIN_KEY"]
        else:
            os.environ["PDSERVE_ADMIN_KEY"] = before
    try:
        ep = cluster.endpoint
        assert ep is not None
        secure = SecureCluster(
            cluster=cluster,
            certs=certs,
            target=ep.grpc[0],
            admin_target=ep.admin[0],
            http_url="",
            redis_url=ep.redis_url,
            model_id=Path(ep.model_dir).name,
            keys_file=keys_file,
        )
        from pdserve.v1 import serving_pb2 as pb

        status = secure.admin().Status(pb.StatusRequest(), metadata=bearer(ADMIN_KEY), timeout=10)
        secure.http_url = status.http_url
        secure.model_id = status.model
        yield secure
    finally:
        cluster.stop()
