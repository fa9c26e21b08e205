"""TEST-ONLY: a pipeline-parallel engine in real processes (one per rank, gloo on CPU).

`PPRanks` spawns rank 0 (an `LLMEngine` that runs a scenario and sends its results back, with
its stage spans) and the other ranks (`serve_stage`, sending back their step count, stage
spans, pool spec and `_kept` counters when rank 0 closes), and bounds every wait on them.
Scenarios are tests/tp_ranks.py's and `serve` / `serve_rounds` / `one_at_a_time` here
(module level, run in rank 0's process; a one-rank engine runs them too, for the reference).
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
    runs: tuple[tuple[EngineConfig, Scenario | None], ...],
    conn: Connection,
    backend: str,
    fault_rank: int,
    slow: tuple[int, float] | None,
) -> None:
    import torch

    from engine.core.engine import LLMEngine
    from engine.core.pp_runner import pipeline_stage, prepare_stage, serve_stage
    from engine.pp.pipeline_group import init_pp_group

    torch.set_num_threads(1)
    config = runs[0][0]
    tp = config.tensor_parallel_size
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        stage = pipeline_stage(config, rank)
        group = init_pp_group(rank, stage, tp, "127.0.0.1", port, backend, config.tp_timeout_s)
        outs: list[Any] = []
        for i, (run_config, scenario) in enumerate(runs):  # one engine after another
            if rank > 0:
                loop = prepare_stage(run_config, group)
                if i == 0 and rank == fault_rank:
                    _fail_stage_after(loop, 3)
                if i == 0 and slow is not None and slow[0] in (rank, -1):
                    _slow_stage(loop, slow[1])
                if i == 0:
                    conn.send("built")
                steps = serve_stage(loop)
                outs.append((steps, list(loop.trace), loop.runner.kv_cache.spec, _kept(loop)))
                continue
            engine = LLMEngine(run_config, pp=group)
            if slow is not None and slow[0] in (0, -1):
                _slow_stage(engine.step_runner.loop, slow[1])
            assert scenario is not None
            result = scenario(engine, conn)
            outs.append((result, list(engine.step_runner.trace)))
            engine.close()
        group.close()
        if len(runs) == 1:
            conn.send(("ok", outs[0]))
        else:
            conn.send(("ok", outs))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _kept(loop: Any) -> dict[str, Any]:
    """What a stage holds beside its pool: its host tier's and LoRA slots' counters."""
    host, loras, graphs = loop.host, loop.loras, loop.runner.graphs
    return {
        "graph_replays": graphs.num_replays if graphs is not None else 0,
        "host_offloaded": host.num_offloaded if host is not None else 0,
        "host_onboarded": host.num_onboarded if host is not None else 0,
        "lora_disk_loads": loras.num_disk_loads if loras is not None else 0,
    }


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

    then: tuple[tuple[EngineConfig, Scenario], ...] = ()
    """Engines built after the first on the same ranks and group, each with its scenario
    (their layer cut must be the first's); with any, each rank's result is a list, one per
    engine (a stage's: steps, trace, pool spec and `_kept`)."""
    fault_rank: int = -1
    """A rank > 0 whose stage raises from its 4th step on; -1: none."""
    slow: tuple[int, float] | None = None
    """(rank, seconds): that rank's stage (-1: every rank's) sleeps that long in each
    micro-batch; None: none."""
    processes: list[BaseProcess] = field(default_factory=list)
    pipes: list[Connection] = field(default_factory=list)

    def start(self) -> PPRanks:
        ctx = rank_context()
        port = free_port()
        for rank in range(self.size):
            ours, theirs = ctx.Pipe()
            runs = ((self.config, self.scenario), *self.then)
            if rank > 0:
                runs = tuple((config, None) for config, _ in runs)
            args = (rank, port, runs, theirs, self.backend, self.fault_rank, self.slow)
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


# ---- scenarios (run by rank 0; tests/tp_ranks.py has more) ---------------------------------

Job = tuple[str, list[int], Any, str]
"""(request id, prompt, SamplingParams, LoRA adapter name or "")."""


def serve(jobs: list[Job], engine: Any, conn: Any) -> dict[str, Any]:
    """Every job at once, to completion (waiting for LoRA reads in flight): per request its
    tokens, logprobs, top alternatives, prompt logprobs and cached prompt tokens; the pool's
    and the model's KV scales, the weight format and the adapter slots refilled from host
    memory (rank 0's cache)."""
    for rid, prompt, params, lora in jobs:
        engine.add_request(rid, prompt, params, lora_name=lora)
    got: dict[str, dict[str, Any]] = {
        rid: {"tokens": [], "logprobs": [], "top": [], "prompt": None, "cached": 0}
        for rid, *_ in jobs
    }
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        outputs = engine.step()
        for o in outputs:
            g = got[o.request_id]
            g["tokens"] += o.new_token_ids
            g["logprobs"] += o.logprobs or ()
            g["top"] += [(t.token_ids, t.logprobs) for t in o.top_logprobs or ()]
            g["prompt"] = g["prompt"] or o.prompt_logprobs
            g["cached"] = o.num_cached_prompt_tokens
        if not outputs and engine.loras.cache is not None:
            engine.loras.cache.wait_for_loads(timeout=30)  # (an adapter's read in flight)
    cache = engine.loras.cache
    return {
        "requests": got,
        "scales": (engine.kv_cache.spec.scales, engine.model_kv_scales),
        "weights": engine.model.quantization,
        "lora_host_loads": cache.stats.num_host_loads if cache is not None else 0,
    }


def one_at_a_time(prompts: list[list[int]], params: Any, engine: Any, conn: Any) -> dict[str, Any]:
    """Each prompt alone, to completion (every step's batch has the shapes of one rank's):
    the tokens of each, and rank 0's decode-graph replays."""
    tokens = [engine.generate([prompt], params)[0] for prompt in prompts]
    graphs = engine.runner.graphs
    return {"tokens": tokens, "graph_replays": graphs.num_replays if graphs is not None else 0}


def serve_rounds(rounds: list[list[Job]], engine: Any, conn: Any) -> dict[str, Any]:
    """`serve` of each list of jobs in turn (the requests of all, the last round's rest)."""
    out: dict[str, Any] = {}
    for jobs in rounds:
        got = serve(jobs, engine, conn)
        out = {**got, "requests": {**out.get("requests", {}), **got["requests"]}}
    return out
