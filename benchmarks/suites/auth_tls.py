"""What API keys and TLS cost a request: TTFT through four routers over the same workers,
side by side in one run on this machine.

A 1P1D cluster (tiny model, CPU; local_prefill_threshold_tokens=0, so every request takes
the disaggregated path) is started in-script with its plain router, then three more router
actors over the same controller and workers, each a separate process like the first:

    plain     no keys, no TLS (the loopback default)
    auth      API keys: the interceptor and the servicer look up the bearer key's digest
    tls       TLS (a certificate made here with the openssl CLI; ECDSA P-256), no keys
    auth+tls  both: what a router beyond loopback runs

The request stream is a sequence of rounds: one request of the same shape (a prompt of its
own random token ids, so no prefix-cache hits; greedy; ignore_eos) through each router, in
an order that rotates from round to round, one request in flight at a time. Each client is
one grpc.aio channel kept open (the TLS handshake happens once per connection, as for a
gateway's pooled connections). TTFT is measured by this process from the send to the first
message carrying tokens.

    overhead = p50(variant) - p50(plain); paired: p50 over rounds of (variant - plain)

    python benchmarks/bench_auth_tls.py [--rounds 300] [--prompt-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from admission.config import AdmissionConfig, AdmissionThresholds
from engine.config import EngineConfig
from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc
from vocabulary.numeric import percentile

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


class Client:
    def __init__(self, name: str, target: str, cert: Path | None, key: str | None) -> None:
        self.name = name
        if cert is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
            self.channel = grpc.aio.secure_channel(target, creds)
        else:
            self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {key}"),) if key else None

    async def ttft_ms(self, prompt: list[int], max_tokens: int) -> float:
        req = pb.GenerateRequest(
            token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        t0 = time.perf_counter()
        first = None
        async for msg in self.stub.Generate(req, metadata=self.metadata, timeout=60):
            if first is None and msg.token_ids:
                first = time.perf_counter()
        assert first is not None
        return (first - t0) * 1000


async def run_rounds(
    clients: list[Client], rounds: int, args: argparse.Namespace, seed: int
) -> dict[str, list[float]]:
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {c.name: [] for c in clients}
    for r in range(rounds):
        order = clients[r % len(clients) :] + clients[: r % len(clients)]
        for client in order:
            prompt = [rng.randrange(10, 500) for _ in range(args.prompt_tokens)]
            samples[client.name].append(await client.ttft_ms(prompt, args.max_tokens))
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300, help="measured rounds (one per router)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import ray

    from deploy.checkpoints.make_model import cached_tiny_model
    from deploy.control.cluster_controller import CONTROLLER_NAME
    from deploy.control.cluster_spec import ClusterSpec, WorkerPlacement
    from deploy.control.config_tree import LaunchConfig, PdserveConfig
    from deploy.control.launch import NAMESPACE, Cluster, loopback_env
    from router.auth import ApiKey
    from router.router_server import RouterActor, RouterConfig
    from router.tls import TlsConfig
    from vocabulary.worker_api import ActorPlacement

    loopback_env()
    model_dir = str(cached_tiny_model())
    folder = Path(tempfile.mkdtemp(prefix="pdserve-bench-tls-"))
    cert, cert_key = make_cert(folder)
    config = PdserveConfig(
        model=model_dir,
        cluster=LaunchConfig(num_cpus=4),
        router=RouterConfig(
            grpc_port=0,
            metrics_port=None,
            admission=AdmissionConfig(
                thresholds=AdmissionThresholds(local_prefill_threshold_tokens=0)
            ),
        ),
        workers=ClusterSpec(
            engine=EngineConfig(model_dir, device="cpu", dtype="float32", num_kv_blocks=1024,
                                attention_backend="torch", cuda_graphs=False),
            placement=WorkerPlacement(default=ActorPlacement(num_cpus=0.5)),
        ),
    )  # fmt: skip
    tls = TlsConfig(str(cert), str(cert_key))
    keys = (ApiKey.of(KEY, "bench"),)
    with Cluster(config) as cluster:
        ep = cluster.endpoint
        assert ep is not None
        base = config.replica_config(0, model_dir, ep.redis_url, block_hash=ep.block_hash)
        variants = {
            "auth": replace(base, api_keys=keys),
            "tls": replace(base, tls=tls),
            "auth+tls": replace(base, api_keys=keys, tls=tls),
        }
        actors = []
        targets = {"plain": ep.target}
        for name, router_config in variants.items():
            actor = (
                ray.remote(RouterActor)
                .options(num_cpus=0, namespace=NAMESPACE)
                .remote(
                    replace(router_config, grpc_port=0, admin_port=0), CONTROLLER_NAME, NAMESPACE
                )
            )
            actors.append(actor)
            targets[name] = f"127.0.0.1:{ray.get(actor.start.remote()).grpc}"
        try:

            async def run() -> dict[str, list[float]]:
                clients = [
                    Client(v, targets[v], cert if "tls" in v else None,
                           KEY if "auth" in v else None)
                    for v in VARIANTS
                ]  # fmt: skip
                try:
                    await run_rounds(clients, args.warmup, args, args.seed + 999)
                    return await run_rounds(clients, args.rounds, args, args.seed)
                finally:
                    for c in clients:
                        await c.channel.close()

            samples = asyncio.run(run())
        finally:
            for actor in actors:
                ray.get(actor.stop.remote(), timeout=30)
                ray.kill(actor)
    print(f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; prompt "
          f"{args.prompt_tokens} tokens, max_tokens {args.max_tokens}, {args.rounds} rounds; "
          "TTFT in ms")  # fmt: skip
    plain = samples["plain"]
    p50_plain = percentile(plain, 50)
    print("| router | TTFT p50 | p90 | p50 - plain | ratio to plain | paired p50 of (x - plain) |")
    print("|---|---:|---:|---:|---:|---:|")
    for v in VARIANTS:
        xs = samples[v]
        p50 = percentile(xs, 50)
        paired = percentile([a - b for a, b in zip(xs, plain, strict=True)], 50)
        print(f"| {v} | {p50:.2f} | {percentile(xs, 90):.2f} | {p50 - p50_plain:+.2f} | "
              f"{p50 / p50_plain:.3f} | {paired:+.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
