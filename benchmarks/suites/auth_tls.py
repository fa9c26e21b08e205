"""What API keys and TLS cost a request: TTFT through four routers over the same workers,
side by side in one run on this machine.

A 1P1D cluster (tiny model, CPU; local_prefill_threshold_tokens=0, so every request takes
the disaggregated path) is started in-script with its plain router, then three more router
actors over the same controller and workers, each a separate process like the first:

    plain     no keys, no TLS (the loopback default)
    auth      API keys: the interceptor and the servicer look up the bearer key's digest
    tls       TLS (a certificate made here with the openssl CLI; ECDSA P-256), no keys
    auth+tls  both: what a router beyond loopback runs

The request stream is a sequence of rounds (benchmarks/harness/ab.py): one request of the
same shape (a prompt of its own random token ids, so no prefix-cache hits; greedy;
ignore_eos) through each router, in an order that rotates from round to round, one request
in flight at a time. Each client is
one grpc.aio channel kept open (the TLS handshake happens once per connection, as for a
gateway's pooled connections). TTFT is measured by this process from the send to the first
message carrying tokens.

    overhead = p50(variant) - p50(plain); paired: p50 over rounds of (variant - plain)

    python -m benchmarks auth_tls [--rounds 300] [--prompt-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.harness.ab import GenerateClient, Sample, closed_rounds, summarize
from benchmarks.harness.cluster import local_cluster, tiny_disaggregated
from benchmarks.harness.table import Table

VARIANTS = ("plain", "auth", "tls", "auth+tls")
KEY = "bench-tenant-key-0123456789abcdef"


def make_cert(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert),
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def client(variant: str, target: str, cert: Path) -> GenerateClient:
    """The client of one router: TLS with the certificate made here, a bearer key."""
    root = cert.read_bytes() if "tls" in variant else None
    bearer = (("authorization", f"Bearer {KEY}"),)
    return GenerateClient(target, root, (lambda: bearer) if "auth" in variant else None)


def table(samples: list[Sample]) -> Table:
    ttft = summarize(samples, VARIANTS, "plain")
    header = ("router", "TTFT p50", "p90", "p50 - plain", "ratio to plain",
              "paired p50 of (x - plain)")  # fmt: skip
    rows = [
        (v, f"{s.p50:.2f}", f"{s.p90:.2f}", f"{s.minus_base_p50:+.2f}", f"{s.ratio_p50:.3f}",
         f"{s.paired_p50:+.2f}")
        for v, s in ttft.items()
    ]  # fmt: skip
    return Table.of(header, rows)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300, help="measured rounds (one per router)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from router.auth import ApiKey
    from router.tls import TlsConfig

    folder = Path(tempfile.mkdtemp(prefix="pdserve-bench-tls-"))
    cert, cert_key = make_cert(folder)
    config = tiny_disaggregated()
    tls = TlsConfig(str(cert), str(cert_key))
    keys = (ApiKey.of(KEY, "bench"),)
    with local_cluster(config) as cluster:
        import ray

        from deploy.control.cluster_controller import CONTROLLER_NAME
        from router.router_server import RouterActor

        namespace = config.cluster.name
        ep = cluster.endpoint
        assert ep is not None
        model_dir = str(config.model)
        base = config.replica_config(0, model_dir, ep.redis_url, block_hash=ep.block_hash)
        variants = {
            "auth": replace(base, api_keys=keys),
            "tls": replace(base, tls=tls),
            "auth+tls": replace(base, api_keys=keys, tls=tls),
        }
        actors: list[Any] = []
        targets = {"plain": ep.target}
        for name, router_config in variants.items():
            actor: Any = (
                ray.remote(RouterActor)
                .options(num_cpus=0, namespace=namespace)
                .remote(
                    replace(router_config, grpc_port=0, admin_port=0), CONTROLLER_NAME, namespace
                )
            )
            actors.append(actor)
            targets[name] = f"127.0.0.1:{ray.get(actor.start.remote()).grpc}"
        try:

            async def run() -> list[Sample]:
                clients = {v: client(v, targets[v], cert) for v in VARIANTS}

                async def send(variant: str, round_: int, prompt: list[int]) -> Sample:
                    return await clients[variant].send(variant, round_, prompt, args.max_tokens)

                try:
                    await closed_rounds(VARIANTS, send, args.warmup, args.prompt_tokens,
                                        args.seed + 999, first_round=-args.warmup)  # fmt: skip
                    return await closed_rounds(
                        VARIANTS, send, args.rounds, args.prompt_tokens, args.seed
                    )
                finally:
                    for c in clients.values():
                        await c.close()

            samples = asyncio.run(run())
        finally:
            for actor in actors:
                ray.get(actor.stop.remote(), timeout=30)
                ray.kill(actor)
    print(f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; prompt "
          f"{args.prompt_tokens} tokens, max_tokens {args.max_tokens}, {args.rounds} rounds; "
          "TTFT in ms")  # fmt: skip
    print(table(samples).markdown())
