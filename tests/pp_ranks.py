"""TEST-ONLY: a pipeline-parallel engine in real processes (one per rank, gloo on CPU).

`PPRanks` spawns rank 0 (an `LLMEngine` that runs a scenario and sends its results back, with
its stage spans) and the other ranks (`serve_stage`, sending back their step count and stage
spans when rank 0 closes), and bounds every wait on them. Scenarios are tests/tp_ranks.py's
(module level, run in rank 0's process).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from tp_ranks import Scenario, TPRanks, free_port, rank_context

from engine.config import EngineConfig


def _rank_main(
    rank: int,
    port: int,
    config: EngineConfig,
    scenario: Scenario | None,
    conn: Connection,
    backend: str,
    fault_rank: int,
    slow: tuple[int, float] | None,
) -> None:
    import torch

    from engine.core.engine import LLMEngine
    from engine.core.pp_runner import StageLoop, pipeline_stage, prepare_stage, serve_stage
    from engine.pp.pipeline_group import init_pp_group

    torch.set_num_threads(1)
    tp = config.tensor_parallel_size
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        stage = pipeline_stage(config, rank)
        group = init_pp_group(rank, stage, tp, "127.0.0.1", port, backend, config.tp_timeout_s)
        if rank > 0:
            loop = StageLoop(group, prepare_stage(config, group))
            if rank == fault_rank:
                _fail_stage_after(loop, 3)
            if slow is not None and slow[0] == rank:
                _slow_stage(loop, slow[1])
            conn.send("built")
            steps = serve_stage(loop)
            group.close()
            conn.send(("ok", (steps, list(loop.trace), loop.runner.kv_cache.spec)))
            return
        engine = LLMEngine(config, pp=group)
        if slow is not None and slow[0] == 0:
            _slow_stage(engine.step_runner.loop, slow[1])
        assert scenario is not None
        result = scenario(engine, conn)
        trace = list(engine.step_runner.trace)
        engine.close()
        group.close()
        conn.send(("ok", (result, trace)))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _fail_stage_after(loop: Any, steps: int) -> None:
    """Make this rank's stage raise in its `steps`+1-th step (a stage that fails mid-step)."""
    real = loop.runner.execute_stage
    calls = [0]

    def failing(batch: Any, carried: Any) -> Any:
        calls[0] += 1
        if calls[0] > steps:
            raise RuntimeError("injected fault in a pipeline stage")
        return real(batch, carried)

    loop.runner.execute_stage = failing


def _slow_stage(loop: Any, seconds: float) -> None:
    """Make this rank's stage take `seconds` longer per micro-batch (inside its span)."""
    import time

    real = loop.runner.execute_stage

    def slow(batch: Any, carried: Any) -> Any:
        out = real(batch, carried)
        time.sleep(seconds)
        return out

    loop.runner.execute_stage = slow


@dataclass
class PPRanks(TPRanks):
    """Rank processes of one PP x TP engine (`config` says the sizes); every rank but 0 sends
    "built" once its part is ready, then its result."""

    fault_rank: int = -1
    """A rank > 0 whose stage raises from its 4th step on; -1: none."""
    slow: tuple[int, float] | None = None
    """(rank, seconds): that rank's stage sleeps that long in each micro-batch; None: none."""
    processes: list[BaseProcess] = field(default_factory=list)
    pipes: list[Connection] = field(default_factory=list)

    def start(self) -> PPRanks:
        ctx = rank_context()
        port = free_port()
        for rank in range(self.size):
            ours, theirs = ctx.Pipe()
            scenario = self.scenario if rank == 0 else None
            args = (rank, port, self.config, scenario, theirs, self.backend, self.fault_rank,
                    self.slow)  # fmt: skip
            p = ctx.Process(target=_rank_main, args=args, daemon=True)
            p.start()
            self.processes.append(p)
            self.pipes.append(ours)
        return self

    def results(self, timeout_s: float = 60.0, ranks: tuple[int, ...] | None = None) -> list[Any]:
        """Every rank's ("ok", result) or ("error", text), rank order ("built" skipped)."""
        out = []
        for got in super().results(timeout_s, ranks):
            out.append(got)
        for i, got in enumerate(out):
            rank = i if ranks is None else ranks[i]
            if got == "built":
                out[i] = self.recv(rank, timeout_s)
        return out


def pp_size(config: EngineConfig) -> int:
    """Ranks of the worker `config` describes."""
    return config.pipeline_parallel_size * config.tensor_parallel_size
