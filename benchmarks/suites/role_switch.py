"""Rebalance time by a role switch vs by a restart: a prefill worker's capacity moves to
decode and back through the admin plane's Rebalance (what `pdserve rebalance` sends), on an
idle cluster, both ways in one run.

A 1P1D cluster is started in-script: by default the tiny model on CPU (benchmarks/harness/
cluster.py); with `--model` a checkpoint on the GPU, one GPU per worker, or both workers on one
(`--gpu-fraction 0.5`). Each round moves the capacity twice: `rebalance 0P2D` then `1P1D`,
once by switch (a worker drains, its engine changes mode, it admits as the other role: the
same actor, model and KV pool) and once with `restart` (a worker is drained and stopped, and
a new one of the other role starts: process, model load, KV pool, NIXL agent), the order
alternating between rounds. Timed: each Rebalance RPC, from its send to its answer (the new
counts ready; routers pick the change up on their next registry refresh, within a second,
either way). The switch's own parts (drain, flip) are read from direct Switch calls.

    python -m benchmarks role_switch [--rounds 3]
    python -m benchmarks role_switch --model /tmp/llama3-8b --make-model --load-format dummy

The GPU figure's goal: switch <= 1/10 of restart (docs/benchmarks.md, "Role switch").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness.cluster import local_cluster, tiny_disaggregated
from benchmarks.harness.steps import progress as log
from benchmarks.harness.table import Table

if TYPE_CHECKING:
    from deploy.control.config_tree import PdserveConfig

MOVES = ((0, 2), (1, 1))
"""One round's rebalances: the prefill worker's capacity to decode, and back."""


def cluster_config(args: argparse.Namespace) -> PdserveConfig:
    """1P1D with an admin plane: the tiny model on CPU, or `--model` on the GPU."""
    from deploy.control.cluster_spec import WorkerPlacement
    from engine.config import EngineConfig
    from vocabulary.worker_api import ActorPlacement

    config = tiny_disaggregated(num_kv_blocks=args.num_kv_blocks or 512, worker_cpus=0.5)
    config = replace(config, router=replace(config.router, admin_port=0))
    if not args.model:
        return config
    engine = EngineConfig(
        model_dir=args.model, dtype="bfloat16", load_format=args.load_format,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len,
    )  # fmt: skip
    placement = WorkerPlacement()
    if args.gpu_fraction is not None:
        placement = WorkerPlacement(default=ActorPlacement(num_gpus=args.gpu_fraction, num_cpus=1))
    workers = replace(config.workers, engine=engine, placement=placement)
    return replace(
        config, model=args.model, workers=workers, cluster=replace(config.cluster, num_cpus=None)
    )


def rebalance(admin: Any, prefill: int, decode: int, restart: bool) -> tuple[float, Any]:
    """(seconds, reply) of one Rebalance; raises unless it did what `restart` asks."""
    from pdserve.v1 import serving_pb2 as pb

    request = pb.RebalanceRequest(prefill=prefill, decode=decode, timeout_s=120, restart=restart)
    t0 = time.perf_counter()
    reply = admin.Rebalance(request, timeout=1800)
    seconds = time.perf_counter() - t0
    moved = bool(reply.started or reply.stopped) if restart else bool(reply.switched)
    if not moved or (restart and reply.switched) or (not restart and reply.started):
        how = "restart" if restart else "switch"
        raise RuntimeError(f"rebalance to {prefill}P{decode}D did not {how}: {reply.message}")
    return seconds, reply


def switch_parts(admin: Any, status: Any, rounds: int) -> tuple[list[float], list[float]]:
    """(drain seconds, flip seconds) of direct switches of the prefill worker and back."""
    from pdserve.v1 import serving_pb2 as pb

    (worker,) = [w.worker_id for w in status().workers if w.role == "prefill"]
    drains, flips = [], []
    for _ in range(rounds):
        for role in ("decode", "prefill"):
            request = pb.SwitchRequest(worker_id=worker, role=role, timeout_s=120, force=True)
            reply = admin.Switch(request, timeout=600)
            if not reply.switched:
                raise RuntimeError(reply.message)
            drains.append(reply.drain_s)
            flips.append(reply.flip_s)
    return drains, flips


def seconds(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds (each: 0P2D and back, both ways)")
    ap.add_argument(
        "--model", help="checkpoint folder: run on the GPU (default: the tiny model, CPU)"
    )
    ap.add_argument(
        "--make-model", action="store_true", help="write the llama3-8b preset at --model if missing"
    )
    ap.add_argument(
        "--load-format", default="auto", choices=("auto", "dummy"), help="dummy: random weights"
    )
    ap.add_argument("--quantization", default="none", help="engine weights: none | fp8")
    ap.add_argument("--kv-cache-dtype", default="auto", help="KV pool: auto | fp8")
    ap.add_argument(
        "--num-kv-blocks",
        type=int,
        default=0,
        help="KV blocks per worker (0: from memory; CPU: 512)",
    )
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument(
        "--gpu-fraction",
        type=float,
        default=None,
        help="GPUs per worker (0.5: both workers on one GPU; default one each)",
    )
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = ap.parse_args(argv)
    if args.model:
        import torch

        if not torch.cuda.is_available():
            print(
                "role_switch --model needs a CUDA GPU (without --model: the tiny model)",
                file=sys.stderr,
            )
            return 2
        if args.make_model and not (Path(args.model) / "config.json").is_file():
            from deploy.checkpoints.make_model import make_model

            make_model(args.model, preset="llama3-8b", device="cuda")
    import grpc

    from pdserve.v1 import serving_pb2 as pb
    from pdserve.v1 import serving_pb2_grpc as pb_grpc

    times: dict[bool, list[float]] = {False: [], True: []}
    with local_cluster(cluster_config(args)) as cluster:
        assert cluster.endpoint is not None
        channel = grpc.insecure_channel(cluster.endpoint.admin[0])
        admin = pb_grpc.AdminStub(channel)
        status = lambda: admin.Status(pb.StatusRequest(), timeout=30)  # noqa: E731
        log(f"1P1D up: {[(w.worker_id, w.role, w.device) for w in status().workers]}")
        for r in range(args.rounds):
            for restart in (r % 2 == 1, r % 2 == 0):
                for prefill, decode in MOVES:
                    took, reply = rebalance(admin, prefill, decode, restart)
                    times[restart].append(took)
                    how = "restart" if restart else "switch"
                    log(f"round {r} {how} {prefill}P{decode}D: {took:.3f}s ({reply.message})")
        drains, flips = switch_parts(admin, status, args.rounds)
        channel.close()
    switch, restart = statistics.median(times[False]), statistics.median(times[True])
    where = "tiny model, CPU" if not args.model else f"{Path(args.model).name}, GPU"
    rows = [
        ("rebalance by switch", seconds(times[False]), f"{switch / restart:.4f}"),
        ("rebalance by restart", seconds(times[True]), "1"),
        ("  switch: drain (idle)", seconds(drains), ""),
        ("  switch: flip", seconds(flips), ""),
    ]
    table = Table.of(
        (f"one worker moved ({where})", "seconds, median (min-max)", "vs restart"), rows
    )
    print(table.render(args.markdown))
    print(f"switch / restart = {switch / restart:.4f} (goal on the GPU: <= 0.1)")
    return 0
