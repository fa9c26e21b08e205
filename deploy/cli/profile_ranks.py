"""The follower ranks of the tensor-parallel engine `pdserve profile --tp N` times: ranks
1..N-1, one process each, running the production follower loop
(engine/core/tp_runner.py:run_follower); rank 0 is the `LLMEngine` in the profiling process.

Lifecycle of `FollowerRanks` (a context manager: leaving it stops the ranks, whether the
profile succeeded or failed):

1. `start`: a free port on 127.0.0.1 for the rendezvous, then one process per follower rank,
   started afresh (`spawn`: it inherits no thread pool and no CUDA context of the profiling
   process). Each sets its intra-op threads (CPU: the worker's `torch_threads`) or its device
   (CUDA: rank r on device r), joins the group (`init_tp_group`: gloo on CPU, NCCL on CUDA)
   and runs `run_follower` until rank 0 closes the engine;
2. `join`: rank 0 joins the group at that port; its `LLMEngine(config, tp=group)` then builds
   with the followers (the start-up collectives need every rank). Every wait on another rank,
   the rendezvous included, is bounded by `EngineConfig.tp_timeout_s` (engine/tp/);
3. `stop`: rank 0 leaves its group (a follower still waiting on it fails at once, gloo), then
   each process is joined within `STOP_TIMEOUT_S`, killed if it is still alive and reaped.
   What each follower reported (its steps, or its error) is kept in `reports`.

A real cluster starts the same loop in Ray actors (worker_runtime/tp_follower.py); here there
is no Ray and no KV transfer, only the engine's steps to time.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import TYPE_CHECKING

from engine.config import EngineConfig

if TYPE_CHECKING:
    from engine.tp.tensor_parallel import TPGroup

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
"""The ranks of a profiled engine run on this machine."""
STOP_TIMEOUT_S = 15.0
"""How long `stop` waits for all followers to return after rank 0 left, before killing them."""
KILL_TIMEOUT_S = 5.0
"""How long a killed follower may take to be reaped."""


def tp_backend(device: str) -> str:
    """The device group's backend: gloo on CPU, NCCL on CUDA."""
    return "gloo" if device == "cpu" else "nccl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _follower_main(
    config: EngineConfig, rank: int, port: int, torch_threads: int, conn: Connection
) -> None:
    """A follower process: join rank 0's group, follow its steps until it closes, report
    ("ok", steps run) or ("error", what failed) on `conn`."""
    try:
        import torch

        from engine.core.tp_runner import run_follower
        from engine.tp.tensor_parallel import init_tp_group

        if config.device == "cpu":
            torch.set_num_threads(max(1, torch_threads))
        else:
            torch.cuda.set_device(rank)
        group = init_tp_group(
            rank, config.tensor_parallel_size, HOST, port, tp_backend(config.device),
            config.tp_timeout_s,
        )  # fmt: skip
        try:
            steps = run_follower(config, group)
        finally:
            group.close()
        conn.send(("ok", steps))
    except BaseException as e:  # the profiling process names it; the exit code says it too
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))
        raise SystemExit(1) from None


class FollowerRanks:
    """Ranks 1..N-1 of an engine of `config` (N = its `tensor_parallel_size`), as processes
    of this machine (module docstring)."""

    def __init__(self, config: EngineConfig, torch_threads: int = 1) -> None:
        if config.tensor_parallel_size < 2:
            raise ValueError(f"followers need tensor_parallel_size >= 2, got "
                             f"{config.tensor_parallel_size}")  # fmt: skip
        self.config = config
        self.torch_threads = torch_threads
        self.port = 0
        self.processes: list[BaseProcess] = []
        self.reports: dict[int, tuple[str, object]] = {}
        """Follower rank → ("ok", steps) or ("error", text); filled by `stop`."""
        self._pipes: list[Connection] = []
        self._group: TPGroup | None = None

    def start(self) -> FollowerRanks:
        ctx = mp.get_context("spawn")
        self.port = _free_port()
        for rank in range(1, self.config.tensor_parallel_size):
            ours, theirs = ctx.Pipe(duplex=False)
            args = (self.config, rank, self.port, self.torch_threads, theirs)
            process = ctx.Process(
                target=_follower_main, args=args, name=f"profile-rank-{rank}", daemon=True
            )
            process.start()
            theirs.close()
            self.processes.append(process)
            self._pipes.append(ours)
        return self

    def join(self) -> TPGroup:
        """Rank 0's group (this process), once every follower has joined it (within
        `tp_timeout_s`); `stop` closes it."""
        from engine.tp.tensor_parallel import init_tp_group

        c = self.config
        self._group = init_tp_group(
            0, c.tensor_parallel_size, HOST, self.port, tp_backend(c.device), c.tp_timeout_s
        )
        return self._group

    def stop(self) -> None:
        """Leave the group, join every follower within STOP_TIMEOUT_S, kill and reap the
        rest (idempotent)."""
        if self._group is not None:
            self._group.close()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for rank, (process, pipe) in enumerate(
            zip(self.processes, self._pipes, strict=True), start=1
        ):
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("profile: TP rank %d did not return: killed", rank)
                process.kill()
                process.join(KILL_TIMEOUT_S)
            if rank not in self.reports:
                self.reports[rank] = _report(pipe, process)
            pipe.close()
            if process.exitcode is not None:
                process.close()
        self.processes, self._pipes = [], []

    def failures(self) -> str:
        """The followers' errors, one per line (empty: none reported one)."""
        return "\n".join(
            f"TP rank {rank}: {text}"
            for rank, (status, text) in sorted(self.reports.items())
            if status != "ok"
        )

    def __enter__(self) -> FollowerRanks:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _report(pipe: Connection, process: BaseProcess) -> tuple[str, object]:
    """What a stopped follower sent, else how it ended."""
    try:
        if pipe.poll(0):
            status, detail = pipe.recv()
            return str(status), detail
    except (EOFError, OSError):
        pass
    return "error", f"sent nothing (exit code {process.exitcode})"
