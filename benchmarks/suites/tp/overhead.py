"""Tensor-parallel step overhead on CPU (gloo, one process per rank, one torch thread each).

Three figures, each the median over `--steps` repetitions:

- control: what rank 0 adds to every step beside the model: the step message (the pickled
  `ScheduledBatch`, `TPGroup.send` → `receive`) and the ranks' agreement that the step ran
  (`TPGroup.agree`), for decode batches of B sequences with 64-block tables (1024 tokens of
  context each), without a model (the followers only receive and agree).
- all-reduce: one device-group all-reduce of a [B, hidden] float32 tensor (a decode step
  does 2 per layer), at the tiny model's hidden size and Llama-3-8B's.
- engine: `LLMEngine.step()` of B decoding requests on the tiny model, TP=1 (this process)
  vs TP=N (rank 0 of N processes), overlap scheduling on (the default).

    python -m benchmarks tp                   # TP=2, B = 1, 8, 64
    python -m benchmarks tp --size 4 --steps 100
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from benchmarks.harness.decode_model import decode_batch
from benchmarks.harness.table import Table
from benchmarks.suites.tp.rank_rpc import free_port
from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.tp_runner import StepMessage, run_follower
from engine.tp.tensor_parallel import TPGroup, init_tp_group
from vocabulary.sampling import SamplingParams

HIDDEN_SIZES = (128, 4096)
TABLE_BLOCKS = 64
BLOCK_SIZE = 16


def engine_config(model_dir: Path, size: int, batch: int) -> EngineConfig:
    return EngineConfig(
        model_dir=str(model_dir), device="cpu", dtype="float32", attention_backend="torch",
        cuda_graphs=False, num_kv_blocks=max(256, 8 * batch), tensor_parallel_size=size,
    )  # fmt: skip


def time_engine(engine: LLMEngine, batch: int, steps: int) -> float:
    """Median seconds of `LLMEngine.step()` with `batch` requests decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 20, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [1 + i % 200, 5, 9, 13], params)
    for _ in range(5):  # prefill, then steady decode
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished():
        for request_id in list(engine.scheduler.requests):
            engine.abort_request(request_id)
        engine.step()
    return statistics.median(times)


def bench_control(group: TPGroup, batches: list[int], steps: int) -> dict[int, float]:
    out = {}
    for b in batches:
        batch = decode_batch(b, TABLE_BLOCKS * BLOCK_SIZE, BLOCK_SIZE)
        times = []
        for i in range(steps):
            t = time.perf_counter()
            if group.rank == 0:
                group.send(StepMessage(i, batch))
            else:
                group.receive()
            group.agree(None)
            times.append(time.perf_counter() - t)
        out[b] = statistics.median(times)
    return out


def bench_all_reduce(
    group: TPGroup, batches: list[int], steps: int
) -> dict[tuple[int, int], float]:
    out = {}
    for hidden in HIDDEN_SIZES:
        for b in batches:
            x = torch.randn(b, hidden)
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                group.all_reduce(x)
                times.append(time.perf_counter() - t)
            out[(b, hidden)] = statistics.median(times)
    return out


def rank_main(
    rank: int, size: int, port: int, model_dir: Path, batches: list[int], steps: int,
    conn: Connection,
) -> None:  # fmt: skip
    torch.set_num_threads(1)
    group = init_tp_group(rank, size, "127.0.0.1", port, "gloo", timeout_s=60.0)
    control = bench_control(group, batches, steps)
    reduce = bench_all_reduce(group, batches, steps)
    engine_s = {}
    for b in batches:
        config = engine_config(model_dir, size, b)
        if rank == 0:
            engine = LLMEngine(config, tp=group)
            engine_s[b] = time_engine(engine, b, steps)
            engine.close()
        else:
            run_follower(config, group)
    group.close()
    if rank == 0:
        conn.send((control, reduce, engine_s))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--size", type=int, default=2, help="TP ranks (processes)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", type=Path, default=None, help="default: the tiny model")
    args = parser.parse_args(argv)
    if args.model is None:
        from deploy.checkpoints.make_model import cached_tiny_model

        args.model = cached_tiny_model()
    torch.set_num_threads(1)
    one = {}
    for b in args.batches:
        one[b] = time_engine(LLMEngine(engine_config(args.model, 1, b)), b, args.steps)
    ctx = mp.get_context("spawn")
    port = free_port()
    ours, theirs = ctx.Pipe()
    procs = [
        ctx.Process(
            target=rank_main,
            args=(r, args.size, port, args.model, args.batches, args.steps, theirs),
        )
        for r in range(args.size)
    ]
    for p in procs:
        p.start()
    if not ours.poll(600):
        raise SystemExit("rank 0 reported nothing within 600 s")
    control, reduce, engine_s = ours.recv()
    for p in procs:
        p.join(30)
    print(f"TP={args.size} over gloo on CPU ({torch.get_num_threads()} thread per rank), "
          f"median of {args.steps} steps")  # fmt: skip
    header = ("B", "control us", *(f"AR h={h} us" for h in HIDDEN_SIZES), "step TP=1 ms",
              "step TP=N ms")  # fmt: skip
    rows = [
        (f"{b}", f"{control[b] * 1e6:.0f}", *(f"{reduce[(b, h)] * 1e6:.0f}" for h in HIDDEN_SIZES),
         f"{one[b] * 1e3:.2f}", f"{engine_s[b] * 1e3:.2f}")
        for b in args.batches
    ]  # fmt: skip
    print(Table.of(header, rows, "r" * len(header)).plain())
