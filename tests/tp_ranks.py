"""TEST-ONLY: a tensor-parallel engine in real processes (one per rank, gloo on CPU).

`TPRanks` spawns rank 0 (an `LLMEngine` that runs a scenario and sends its results back) and
the followers (`run_follower`), and bounds every wait on them. Scenario functions run in the
rank-0 process and must be importable (module level here).

Rank processes are forked from one server process per test process that imported torch and
the engine once (`rank_context`), not started afresh each (a fresh Python spent ~2 CPU-s on
those imports before it did anything): the server runs no torch op, so each child starts
with no thread pool and no device context of the parent's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

from engine.config import EngineConfig

Scenario = Callable[[Any, Connection], Any]
"""(rank 0's LLMEngine, the pipe to the test) -> the result sent back."""


RANK_MODULES = (
    "torch",
    "engine.core.engine",
    "engine.core.tp_runner",
    "engine.core.pp_runner",
    "engine.tp.tensor_parallel",
    "engine.pp.pipeline_group",
    "tp_ranks",
    "pp_ranks",
)
"""What every rank process imports: the fork server's preload."""


def rank_context() -> BaseContext:
    """Processes forked from this test process's fork server (started at the first rank,
    with `RANK_MODULES` imported)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_MODULES))
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _inject_fault(where: str, at_call: int) -> None:
    """Make this process raise on the `at_call`-th call of SiLU-and-mul (`where` "mlp":
    between a layer's two all-reduces) or of the head (`where` "logits": after the last)."""
    from engine.modeling.layer_ops import TORCH_OPS
    from engine.modeling.llama import LlamaModel

    owner: Any = TORCH_OPS if where == "mlp" else LlamaModel
    name = "silu_and_mul" if where == "mlp" else "compute_logits"
    real = getattr(owner, name)
    calls = [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at_call:
            raise RuntimeError(f"injected fault in {name}")
        return real(*args, **kwargs)

    setattr(owner, name, failing)


def _rank_main(
    rank: int,
    size: int,
    port: int,
    config: EngineConfig,
    scenario: Scenario | None,
    conn: Connection,
    backend: str,
    fault: tuple[str, int] | None,
) -> None:
    import torch

    from engine.core.engine import LLMEngine
    from engine.core.tp_runner import run_follower
    from engine.tp.tensor_parallel import init_tp_group

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    if fault is not None and rank == 1:
        _inject_fault(*fault)
    try:
        group = init_tp_group(rank, size, "127.0.0.1", port, backend, config.tp_timeout_s)
        if rank > 0:
            steps = run_follower(config, group)
            group.close()
            conn.send(("ok", steps))
            return
        engine = LLMEngine(config, tp=group)
        assert scenario is not None
        result = scenario(engine, conn)
        engine.close()
        group.close()
        conn.send(("ok", result))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


@dataclass
class TPRanks:
    """Rank processes of one TP engine; `results()` waits for every rank's report."""

    size: int
    config: EngineConfig
    scenario: Scenario
    backend: str = "gloo"
    fault: tuple[str, int] | None = None
    """(where, n): rank 1 raises at the n-th call there (`_inject_fault`); None: never."""
    processes: list[BaseProcess] = field(default_factory=list)
    pipes: list[Connection] = field(default_factory=list)

    def start(self) -> TPRanks:
        ctx = rank_context()
        port = free_port()
        for rank in range(self.size):
            ours, theirs = ctx.Pipe()
            scenario = self.scenario if rank == 0 else None
            args = (rank, self.size, port, self.config, scenario, theirs, self.backend,
                    self.fault)  # fmt: skip
            p = ctx.Process(target=_rank_main, args=args, daemon=True)
            p.start()
            self.processes.append(p)
            self.pipes.append(ours)
        return self

    def recv(self, rank: int, timeout_s: float) -> Any:
        """The next message rank `rank` sends (AssertionError after `timeout_s`)."""
        if not self.pipes[rank].poll(timeout_s):
            raise AssertionError(f"rank {rank} sent nothing within {timeout_s} s")
        return self.pipes[rank].recv()

    def kill(self, rank: int) -> None:
        pid = self.processes[rank].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        self.processes[rank].join(10)

    def results(self, timeout_s: float = 60.0, ranks: tuple[int, ...] | None = None) -> list[Any]:
        """Every rank's ("ok", result) or ("error", text), rank order."""
        deadline = time.monotonic() + timeout_s
        out = []
        for rank in ranks if ranks is not None else range(self.size):
            out.append(self.recv(rank, max(0.1, deadline - time.monotonic())))
        return out

    def stop(self) -> None:
        for p in self.processes:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


# ---- scenarios (run by rank 0) --------------------------------------------------------------


def generate_rounds(
    prompts: list[list[int]], params: Any, rounds: int, engine: Any, conn: Connection | None
) -> dict[str, Any]:
    """Every prompt at once, `rounds` times (later rounds hit the prefix cache): "rounds" per
    round, per prompt (output tokens, cached prompt tokens); "spec": rank 0's KV pool spec.
    Before, a malformed batch must fail with ValueError on every rank and leave the engine
    serving."""
    from engine.batch import ScheduledBatch, SeqChunk

    bad = ScheduledBatch((SeqChunk("bad", (1, 2), 0, (10**6,), sample=True),))
    try:
        engine.step_runner.execute(bad)
    except ValueError:
        pass
    else:
        raise AssertionError("a block id past the pool did not fail the step")
    out = []
    for r in range(rounds):
        ids = [f"r{r}-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts, strict=True):
            engine.add_request(request_id, prompt, params)
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        cached: dict[str, int] = {}
        while engine.has_unfinished():
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids
                cached[o.request_id] = o.num_cached_prompt_tokens
        out.append([(tokens[i], cached[i]) for i in ids])
    return {"rounds": out, "spec": engine.kv_cache.spec}


def step_until_error(prompt: list[int], params: Any, engine: Any, conn: Connection) -> Any:
    """Step one request until a step raises: (seconds from the first step, error type, message)."""
    engine.add_request("f", prompt, params)
    started = time.monotonic()
    try:
        while engine.has_unfinished():
            engine.step()
    except Exception as e:
        return time.monotonic() - started, type(e).__name__, str(e)
    return time.monotonic() - started, "", "no step raised"


def fail_then_generate(prompt: list[int], params: Any, engine: Any, conn: Connection) -> Any:
    """`step_until_error`, then abort what was in flight (as EngineDriver does) and generate
    `prompt` again: (that error, the tokens)."""
    failed = step_until_error(prompt, params, engine, conn)
    engine.abort_request("f")
    return failed, engine.generate([prompt], params)[0]


def step_after_kill(prompt: list[int], params: Any, engine: Any, conn: Connection) -> Any:
    """Decode a few steps, tell the test ("ready"), wait until it has killed a follower,
    then step until a step raises: (seconds to the raise, error type, message)."""
    engine.add_request("k", prompt, params)
    for _ in range(3):
        engine.step()
    conn.send("ready")
    assert conn.recv() == "killed"
    started = time.monotonic()
    try:
        for _ in range(100):
            engine.step()
    except Exception as e:
        return time.monotonic() - started, type(e).__name__, str(e)
    return time.monotonic() - started, "", "no step raised"


def decode_logits_vs_whole(engine: Any, conn: Connection) -> dict[str, Any]:
    """Through rank 0's step runner: a prefill of three sequences, then one decode step of
    each (a CUDA-graph replay where captured); the same two batches on a whole model of the
    same dummy weights, eager, in this process. The graph replays of the TP decode, and per
    batch the largest logit difference and the largest reference logit."""
    from engine.batch import ScheduledBatch, SeqChunk
    from engine.core.runner import ModelRunner
    from engine.kv.kv_cache import KVCache
    from engine.kv.kv_sizing import kv_cache_spec
    from engine.loading.loaders import load_model

    config = engine.config
    prompts = [list(range(1, 6)), [7] * 20, [9, 8, 7]]
    tables = [tuple(range(4 * i, 4 * i + 4)) for i in range(len(prompts))]
    prefill = ScheduledBatch(
        tuple(SeqChunk(f"s{i}", tuple(p), 0, tables[i], sample=True) for i, p in enumerate(prompts))
    )
    decode = ScheduledBatch(
        tuple(
            SeqChunk(f"s{i}", (11 + i,), len(p), tables[i], sample=True)
            for i, p in enumerate(prompts)
        )
    )
    graphs = engine.runner.graphs
    before = graphs.num_replays if graphs is not None else 0
    got = [engine.step_runner.execute(b).float().cpu() for b in (prefill, decode)]
    replays = (graphs.num_replays if graphs is not None else 0) - before
    device = engine.runner.device
    model = load_model(
        config.model_dir, engine.model.dtype, device, load_format="dummy", seed=config.seed
    )
    spec = kv_cache_spec(model.cfg, config.block_size, model.dtype, config.num_kv_blocks)
    whole = replace(config, tensor_parallel_size=1, cuda_graphs=False)
    runner = ModelRunner(model, KVCache(spec, device), whole)
    want = [runner.execute(b).float().cpu() for b in (prefill, decode)]
    return {
        "replays": replays,
        "max_diff": [float((g - w).abs().max()) for g, w in zip(got, want, strict=True)],
        "max_logit": [float(w.abs().max()) for w in want],
    }


def teacher_forced(engine: Any, ids: list[int]) -> Any:
    """Float32 logits of the last position of `ids`, one prefill chunk through the engine's
    step runner over blocks from 0 (their KV is overwritten: use on an engine that serves
    nothing more)."""
    from engine.batch import ScheduledBatch, SeqChunk
    from vocabulary.numeric import cdiv

    blocks = tuple(range(cdiv(len(ids), engine.config.block_size)))
    chunk = SeqChunk("teacher-forced", tuple(ids), 0, blocks, sample=True)
    return engine.step_runner.execute(ScheduledBatch((chunk,)))[0].float().cpu()


def generate_then_teacher_force(
    prompts: list[list[int]], params: Any, engine: Any, conn: Connection
) -> Any:
    """Send the test each prompt's greedy tokens, receive sequences, return their
    `teacher_forced` logits and the model's KV scales (rank 0's pool's; a pipeline's: every
    stage's)."""
    conn.send(generate_rounds(prompts, params, 1, engine, None)["rounds"][0])
    scales = engine.model_kv_scales or engine.kv_cache.spec.scales
    return [teacher_forced(engine, seq) for seq in conn.recv()], scales
