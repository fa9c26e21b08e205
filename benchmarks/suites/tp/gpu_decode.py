"""The decode part of the tp_gpu suite (benchmarks/suites/tp/gpu.py): one process per TP rank,
as a TP worker runs its ranks (engine/core/tp_runner.py).

Rank r of TP=N, in its own process on device cuda:r (the CPU in a `--cpu` run):
1. measures its device's copy bandwidth (read + write counted: the floor's denominator);
2. joins the group (NCCL on GPUs, gloo on CPU) and times one all-reduce of [B, hidden] per
   batch size B, eagerly (a decode step does 2 per layer, replayed inside its CUDA graph);
3. rank 0 builds `LLMEngine(config, tp=group)` (dummy weights made on the device from
   config.json, CUDA graphs captured with the all-reduces inside) while each follower builds
   its part (`prepare_follower`) and then serves rank 0's steps (`serve_follower`);
4. every rank fills its KV pool with random values, and the check's blocks with the same
   values for each model KV head at any TP size (`fill_check_kv`); rank 0 runs one decode
   step of one sequence over those blocks and keeps its logits for the driver to compare
   across TP sizes (the dummy weights of a seed are the same model at any TP size,
   engine/loading/dummy_weights.py; a prefill would build a prefill kernel for nothing else);
5. rank 0 times `engine.step_runner.execute` on decode batches of B sequences of `context`
   tokens each (TP=1: the runner; TP=N: the `TPLeader`, so the step message, every rank's
   graph replay and the ranks' agreement are all in the time), counting graph replays.

`run_decode` starts the ranks and collects what they report, every wait bounded.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, cast

import numpy as np
import torch

from benchmarks.harness.cuda_timing import copy_bytes_per_s, seconds_per_call
from benchmarks.harness.decode_model import decode_batch, weight_read_bytes
from benchmarks.suites.tp.rank_rpc import free_port
from engine.batch import ScheduledBatch, SeqChunk
from engine.config import EngineConfig
from engine.kv.kv_cache import KVCache
from engine.modeling.llama import LlamaModel
from kv_transfer.tp_plan import kv_heads_of
from vocabulary.model_config import ModelConfig
from vocabulary.numeric import cdiv

CHECK_TOKENS = 40
"""Context tokens of the check's decode step, whose logits are compared across TP sizes."""
CHECK_BLOCKS = 4
"""Blocks of the check's context (after the decode batches' blocks)."""
ALL_REDUCE_ITERS = 50


@dataclass(frozen=True)
class DecodeSetup:
    """What every rank of one decode run builds and measures."""

    model_dir: str
    cuda: bool
    batches: tuple[int, ...]
    context: int
    block_size: int
    iters: int
    kv_layout: str
    copy_mib: int
    timeout_s: float

    @property
    def decode_blocks(self) -> int:
        """Blocks the largest decode batch reads (the check's blocks come after them)."""
        return max(self.batches) * cdiv(self.context, self.block_size)

    def engine_config(self, tp_size: int) -> EngineConfig:
        max_batch = max(self.batches)
        return EngineConfig(
            model_dir=self.model_dir,
            device="cuda" if self.cuda else "cpu",
            dtype="bfloat16" if self.cuda else "float32",
            load_format="dummy",
            attention_backend="flashinfer" if self.cuda else "torch",
            cuda_graphs=self.cuda,
            cuda_graph_max_batch=max_batch,
            max_num_seqs=max_batch,
            max_model_len=max(self.context, CHECK_BLOCKS * self.block_size),
            num_kv_blocks=self.decode_blocks + CHECK_BLOCKS + 8,
            kv_layout=self.kv_layout,
            host_kv_gb=0,
            tensor_parallel_size=tp_size,
            tp_timeout_s=self.timeout_s,
        )


@dataclass(frozen=True)
class RankReport:
    """One rank's device, copy bandwidth and the weight bytes its decode step reads."""

    rank: int
    device: str
    copy_bytes_per_s: float
    weight_bytes: int
    """Its model (part)'s parameters, less the embedding table where the head is separate
    (the table is only gathered): what `rank_step_bytes(...).weights` must equal."""
    kv_bytes_per_token: int
    """Its KV pool's bytes per token (its KV heads, every layer, K and V)."""


@dataclass(frozen=True)
class BatchTiming:
    batch: int
    step_s: float
    """Mean seconds of one decode step over the timed steps (synchronized at both ends)."""
    graph_replays: int
    """CUDA-graph replays during the warm-up and timed steps (0: it ran eagerly)."""
    steps: int
    """Warm-up and timed steps run."""
    all_reduce_s: float
    """One eager all-reduce of [B, hidden] in the model dtype (0 with one rank)."""


@dataclass(frozen=True)
class DecodeRun:
    """What rank 0 of a TP=`tp_size` run reports."""

    tp_size: int
    ranks: tuple[RankReport, ...]
    timings: tuple[BatchTiming, ...]
    check_logits: np.ndarray
    """Float32 logits [vocab] of the check's decode step (numpy: a torch tensor would
    travel through shared memory its sender may no longer hold)."""
    attention: str
    layer_ops: str
    graph_sizes: tuple[int, ...]


def fill_check_kv(kv_cache: KVCache, cfg: ModelConfig, setup: DecodeSetup) -> None:
    """Write the check's KV (module docstring, 4) into this rank's pool: the same values for
    a model KV head on every TP size (drawn whole on the host, this rank's heads kept)."""
    spec = kv_cache.spec
    gen = torch.Generator().manual_seed(1234)
    shape = (CHECK_BLOCKS, 2, setup.block_size, cfg.num_kv_heads, cfg.head_dim)
    heads = kv_heads_of(cfg.num_kv_heads, spec.tp_size, spec.tp_rank)
    first = setup.decode_blocks
    for layer in range(spec.num_layers):
        whole = torch.randn(shape, generator=gen)
        part = whole[:, :, :, heads.start : heads.stop].to(kv_cache.tensor.dtype)
        kv_cache.layer(layer)[first : first + CHECK_BLOCKS].copy_(part)


def check_logits(
    execute: Callable[[ScheduledBatch], torch.Tensor], setup: DecodeSetup
) -> np.ndarray:
    """Logits [vocab] of one decode step at position CHECK_TOKENS over `fill_check_kv`'s
    blocks (module docstring, 4): no prefill, so no prefill kernel to build."""
    first = setup.decode_blocks
    blocks = tuple(range(first, first + cdiv(CHECK_TOKENS + 1, setup.block_size)))
    step = SeqChunk("check", (17,), CHECK_TOKENS, blocks, sample=True)
    return execute(ScheduledBatch((step,)))[0].float().cpu().numpy()


def _time_all_reduces(
    group: Any, setup: DecodeSetup, hidden: int, device: torch.device, dtype: torch.dtype
) -> dict[int, float]:
    out = {}
    for b in setup.batches:
        x = torch.ones(b, hidden, dtype=dtype, device=device)
        out[b] = seconds_per_call(
            functools.partial(group.all_reduce, x), ALL_REDUCE_ITERS, device, warmup=5
        )
    return out


def decode_rank(rank: int, size: int, port: int, setup: DecodeSetup, conn: Connection) -> None:
    """One rank's process (module docstring); reports ("report" | "run" | "error", ...)."""
    from engine.core.engine import LLMEngine
    from engine.core.tp_runner import prepare_follower, serve_follower
    from engine.tp.tensor_parallel import init_tp_group

    try:
        if setup.cuda:
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            torch.set_num_threads(1)
            device = torch.device("cpu")
        copy_bw = copy_bytes_per_s(device, setup.copy_mib << 20)
        cfg = ModelConfig.from_pretrained(setup.model_dir)
        config = setup.engine_config(size)
        dtype = torch.bfloat16 if setup.cuda else torch.float32
        group = None
        reduces: dict[int, float] = {}
        if size > 1:
            group = init_tp_group(rank, size, "127.0.0.1", port, timeout_s=setup.timeout_s)
            reduces = _time_all_reduces(group, setup, cfg.hidden_size, device, dtype)

        def report(model: LlamaModel, kv_per_token: int) -> RankReport:
            weights = weight_read_bytes(model)
            return RankReport(rank, str(device), copy_bw, weights, kv_per_token)

        if rank > 0:
            assert group is not None
            runner = prepare_follower(config, group)
            runner.kv_cache.tensor.normal_()
            fill_check_kv(runner.kv_cache, cfg, setup)
            spec = runner.kv_cache.spec
            conn.send(("report", report(runner.model, spec.block_nbytes // spec.block_size)))
            steps = serve_follower(group, runner)
            group.close()
            conn.send(("done", steps))
            return
        engine = LLMEngine(config, tp=group)
        engine.kv_cache.tensor.normal_()
        fill_check_kv(engine.kv_cache, cfg, setup)
        execute = engine.step_runner.execute
        logits = check_logits(execute, setup)
        graphs = engine.runner.graphs
        timings = []
        for b in setup.batches:
            batch = decode_batch(b, setup.context, setup.block_size)
            before = graphs.num_replays if graphs is not None else 0
            warmup = 3
            sec = seconds_per_call(
                functools.partial(execute, batch), setup.iters, device, warmup=warmup
            )
            replays = (graphs.num_replays if graphs is not None else 0) - before
            timings.append(BatchTiming(b, sec, replays, warmup + setup.iters, reduces.get(b, 0.0)))
        spec = engine.kv_cache.spec
        own = report(engine.model, spec.block_nbytes // spec.block_size)
        run = DecodeRun(
            size,
            (own,),
            tuple(timings),
            logits,
            engine.runner.attention_backend,
            engine.runner.layer_ops.name,
            graphs.sizes if graphs is not None else (),
        )
        engine.close()
        if group is not None:
            group.close()
        conn.send(("run", run))
    except BaseException as e:
        conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_decode(setup: DecodeSetup, tp_size: int, timeout_s: float) -> DecodeRun:
    """Start TP=`tp_size` ranks (rank r on device r), wait for rank 0's run and every
    follower's report; raises RuntimeError naming the rank that failed or went silent."""
    ctx = mp.get_context("spawn")
    port = free_port()
    pipes, procs = [], []
    for rank in range(tp_size):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(
            target=decode_rank,
            args=(rank, tp_size, port, setup, theirs),
            name=f"tp{tp_size}-rank{rank}",
            daemon=True,
        )
        p.start()
        theirs.close()
        pipes.append(ours)
        procs.append(p)
    deadline = time.monotonic() + timeout_s
    failed = True
    try:
        got = _collect(pipes, procs, deadline)
        run = got[0]
        assert isinstance(run, DecodeRun)
        reports = tuple(got[r] for r in range(1, tp_size))
        failed = False
        return DecodeRun(
            run.tp_size,
            (*run.ranks, *reports),
            run.timings,
            run.check_logits,
            run.attention,
            run.layer_ops,
            run.graph_sizes,
        )
    finally:  # after a failure the others may wait in a collective: end them soon
        for p in procs:
            p.join(2.0 if failed else max(1.0, min(30.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(5.0)


def _collect(pipes: list[Connection], procs: list[Any], deadline: float) -> dict[int, Any]:
    """Rank 0's "run" and each follower's "report", whichever comes first; RuntimeError at
    the first error any rank sends, when one dies without a word, or at the deadline."""
    want = {rank: "run" if rank == 0 else "report" for rank in range(len(pipes))}
    got: dict[int, Any] = {}
    while want:
        waiting = {pipes[rank]: rank for rank in want}
        for conn in wait(list(waiting), timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
            rank = waiting[cast(Connection, conn)]
            try:
                kind, value = pipes[rank].recv()
            except EOFError:
                raise RuntimeError(f"rank {rank} exited without a report") from None
            if kind == "error":
                raise RuntimeError(value)
            if kind == want[rank]:
                got[rank] = value
                del want[rank]
        for rank in want:
            if not procs[rank].is_alive() and not pipes[rank].poll():
                code = procs[rank].exitcode
                raise RuntimeError(f"rank {rank} exited (code {code}) without a report")
        if want and time.monotonic() >= deadline:
            raise RuntimeError(f"ranks {sorted(want)} reported nothing before the part's deadline")
    return got
