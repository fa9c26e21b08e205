"""Pipeline parallelism on two GPUs: prefill of a long prompt and the decode step, PP=2 vs
TP=2 vs one GPU. Needs two GPUs (device kind nvidia-h200-x2); `--cpu` runs the same code on the
CPU with the tiny model (gloo, torch attention): a check that the script works, its figures
mean nothing.

A Llama-3-8B-shaped model from its config alone (dummy bf16 weights made on each device, as
`--load-format dummy`; a stage draws every layer and keeps its own, so all three layouts
serve the same model), one process per rank as a worker runs them (engine/core/pp_runner.py,
engine/core/tp_runner.py; NCCL, flashinfer attention). Per layout:

    prefill   one prompt of N tokens (`--prefill-tokens`, 8192 and 32768) as one step's chunk,
              through rank 0's step runner (PP=2: cut into `--micro-batches` micro-batches, so
              the stages overlap; TP=2: every layer's two all-reduces), median of `--repeats`
    decode    a decode step of B sequences of `--context` tokens each (`--batches`), sampled
              as serving samples it (top-k 50 at temperature 0.8: on one rank after the
              model; PP=2: on the last stage, which sends rank 0 only the token ids); PP=2
              also the arrangement it replaced ("rank 0 samples": the last stage sends the
              logits, rank 0 samples)
    serve     B requests (`--serve-batches`, 8 and 32) of a `--context`-token prompt decode
              `--serve-tokens` each through `LLMEngine.step`: milliseconds per output token
              of steady decoding, so a pipeline's schedule counts (pp2: the default,
              pp2-cross / pp2-within: `pipeline_schedule` named)

Without `--graphs` every layout runs eager (`cuda_graphs` off for all), so the comparison is
of the split; with it, one GPU and TP=2 replay their decode graphs and each PP=2 stage its own
(engine/core/cuda_graphs.py), as they serve.
Exit status: 0 when every layout ran; 1 when one failed (the others still run); 2 with fewer
than two CUDA GPUs (nothing run) or bad arguments.

    python -m benchmarks pp                       # 2 GPUs
    python -m benchmarks pp --prefill-tokens 8192 --batches 1,64
    python -m benchmarks pp --graphs --layouts one,tp2,pp2-cross,pp2-within
    python -m benchmarks pp --cpu                 # the plumbing, no GPU
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks.harness.table import Table
from benchmarks.suites.tp.rank_rpc import free_port

LAYOUTS = {
    "one": (1, 1, ""),
    "tp2": (1, 2, ""),
    "pp2": (2, 1, ""),
    "pp2-cross": (2, 1, "cross_step"),
    "pp2-within": (2, 1, "within_step"),
}
"""Layout name → (pipeline stages, TP ranks, `pipeline_schedule`; "": the default)."""
TIMEOUT_S = 900.0
GPU_DEFAULTS = {
    "prefill_tokens": "8192,32768", "batches": "1,16,64", "context": 2048, "repeats": 5,
    "serve_batches": "8,32", "serve_tokens": 128,
}  # fmt: skip
CPU_DEFAULTS = {
    "prefill_tokens": "256", "batches": "1,4", "context": 64, "repeats": 2,
    "serve_batches": "8", "serve_tokens": 16,
}  # fmt: skip


@dataclass(frozen=True)
class Setup:
    """What every rank of one layout builds and rank 0 times."""

    model_dir: str
    cuda: bool
    prefill_tokens: tuple[int, ...]
    batches: tuple[int, ...]
    context: int
    repeats: int
    micro_batches: int
    serve_batches: tuple[int, ...] = ()
    serve_tokens: int = 0
    graphs: bool = False
    block_size: int = 16

    def engine(self, pp: int, tp: int, schedule: str = "") -> Any:
        from engine.config import EngineConfig
        from vocabulary.numeric import cdiv

        longest = max((*self.prefill_tokens, self.context))
        seqs = max((*self.batches, *self.serve_batches))
        per_seq = cdiv(self.context + self.serve_tokens, self.block_size)
        blocks = max(cdiv(longest, self.block_size), seqs * per_seq)
        return EngineConfig(
            model_dir=self.model_dir, device="cuda" if self.cuda else "cpu",
            dtype="bfloat16" if self.cuda else "float32", load_format="dummy",
            attention_backend="flashinfer" if self.cuda else "torch",
            cuda_graphs=self.graphs, max_num_seqs=seqs,
            max_num_batched_tokens=max(longest, seqs),
            max_model_len=max(longest, self.context + self.serve_tokens),
            num_kv_blocks=blocks + 8, block_size=self.block_size, host_kv_gb=0,
            pipeline_parallel_size=pp, tensor_parallel_size=tp,
            pipeline_micro_batches=self.micro_batches, tp_timeout_s=TIMEOUT_S,
            pipeline_schedule=schedule or EngineConfig.pipeline_schedule,
        )  # fmt: skip


def _rank_main(
    rank: int, layout: tuple[int, int, str], port: int, setup: Setup, conn: Connection
) -> None:
    import torch

    from engine.core.engine import LLMEngine
    from engine.core.pp_runner import pipeline_stage, run_stage
    from engine.core.tp_runner import run_follower
    from engine.pp.pipeline_group import init_pp_group
    from engine.tp.tensor_parallel import init_tp_group

    pp, tp, schedule = layout
    try:
        if setup.cuda:
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)
        config = setup.engine(pp, tp, schedule)
        if pp * tp == 1:
            conn.send(("ok", _time_rank0(LLMEngine(config), setup)))
            return
        if pp > 1:
            stage = pipeline_stage(config, rank)
            group: Any = init_pp_group(rank, stage, tp, "127.0.0.1", port, timeout_s=TIMEOUT_S)
        else:
            group = init_tp_group(rank, tp, "127.0.0.1", port, timeout_s=TIMEOUT_S)
        if rank > 0:
            if pp > 1:
                run_stage(config, group)
            else:
                run_follower(config, group)
            group.close()
            conn.send(("ok", None))
            return
        engine = LLMEngine(config, pp=group) if pp > 1 else LLMEngine(config, tp=group)
        result = _time_rank0(engine, setup)
        engine.close()
        group.close()
        conn.send(("ok", result))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _time_rank0(engine: Any, setup: Setup) -> dict[str, float]:
    """Median seconds of each prefill and decode step through rank 0's step runner."""
    import torch

    from benchmarks.harness.decode_model import decode_batch
    from engine.batch import ScheduledBatch, SeqChunk
    from engine.core.pp_runner import PPLeader
    from engine.core.sampler import SamplingRow
    from vocabulary.numeric import cdiv
    from vocabulary.sampling import SamplingParams

    device = engine.kv_cache.device
    runner = engine.step_runner
    params = SamplingParams(temperature=0.8, top_k=50)

    def logits(batch: ScheduledBatch) -> None:
        runner.execute(batch)

    def sampled(batch: ScheduledBatch, on_rank0: bool = False) -> None:
        rows = [SamplingRow(params, (), ()) for c in batch.chunks if c.sample]
        if isinstance(runner, PPLeader) and not on_rank0:
            runner.execute_sampled(batch, (), rows, None)[0].to_host()
        else:
            engine.sampler.sample(runner.execute(batch), rows).to_host()

    def median(step: Callable[[ScheduledBatch], None], batch: ScheduledBatch) -> float:
        times = []
        for _ in range(setup.repeats + 1):  # the first builds kernels
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            step(batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    out: dict[str, float] = {}
    for n in setup.prefill_tokens:
        blocks = tuple(range(cdiv(n, setup.block_size)))
        chunk = SeqChunk("p", tuple(i % 1000 + 1 for i in range(n)), 0, blocks, sample=True)
        out[f"prefill {n}"] = median(logits, ScheduledBatch((chunk,)))
    for b in setup.batches:
        batch = decode_batch(b, setup.context, setup.block_size)
        out[f"decode B={b}"] = median(sampled, batch)
        if isinstance(runner, PPLeader):
            out[f"decode B={b}, rank 0 samples"] = median(
                functools.partial(sampled, on_rank0=True), batch
            )
    for b in setup.serve_batches:
        out[f"serve B={b}, ms per output token"] = _serve(engine, setup, b)
    return out


def _serve(engine: Any, setup: Setup, batch: int) -> float:
    """Seconds per output token of steady decoding through `LLMEngine.step` (the engine's
    schedule: a pipeline's groups in flight, or not): `batch` greedy requests of a
    `context`-token prompt each decode `serve_tokens`; timed from the step after the last
    first token to the end, over the tokens those steps gave."""
    from vocabulary.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=setup.serve_tokens, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        prompt = [(7 * i + 13 * j) % (vocab - 1) + 1 for j in range(setup.context)]
        engine.add_request(f"serve-{batch}-{i}", prompt, params)
    started: set[str] = set()
    t0, tokens = 0.0, 0
    while engine.has_unfinished():
        outputs = engine.step()
        if len(started) == batch:
            tokens += sum(len(o.new_token_ids) for o in outputs)
            continue
        started.update(o.request_id for o in outputs if o.new_token_ids)
        if len(started) == batch:
            t0 = time.perf_counter()
    return (time.perf_counter() - t0) / max(tokens, 1)


def run_layout(name: str, setup: Setup) -> dict[str, float] | str:
    """Rank 0's timings of one layout, or why it failed."""
    pp, tp, _ = layout = LAYOUTS[name]
    ctx = mp.get_context("spawn")
    port = free_port()
    pipes, procs = [], []
    for rank in range(pp * tp):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=_rank_main, args=(rank, layout, port, setup, theirs), daemon=True)
        p.start()
        pipes.append(ours)
        procs.append(p)
    try:
        results = []
        for rank, pipe in enumerate(pipes):
            if not pipe.poll(TIMEOUT_S):
                return f"rank {rank} sent nothing in {TIMEOUT_S:g} s"
            results.append(pipe.recv())
        failed = [text for status, text in results if status != "ok"]
        return failed[0] if failed else results[0][1]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="the tiny model on the CPU (a check)")
    ap.add_argument("--layouts", default="one,tp2,pp2", help="of: one, tp2, pp2")
    ap.add_argument("--prefill-tokens", help="[8192,32768; --cpu: 256]")
    ap.add_argument("--batches", help="[1,16,64; --cpu: 1,4]")
    ap.add_argument("--context", type=int, help="[2048; --cpu: 64]")
    ap.add_argument("--repeats", type=int, help="[5; --cpu: 2]")
    ap.add_argument(
        "--micro-batches",
        type=int,
        default=0,
        help="PP=2's per step (and cross_step's groups) [0: the engine's]",
    )
    ap.add_argument(
        "--serve-batches",
        help="requests decoding at once through the engine's "
        "steps, per layout [8,32; --cpu: 8]; '' for none",
    )
    ap.add_argument("--serve-tokens", type=int, help="tokens each decodes [128; --cpu: 16]")
    ap.add_argument(
        "--graphs",
        action="store_true",
        help="CUDA graphs on (a PP stage captures its layers' decode) [off]",
    )
    args = ap.parse_args(argv)
    # the tiny model's context is short: --cpu is a check unless told more
    defaults = CPU_DEFAULTS if args.cpu else GPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.layouts = [x for x in args.layouts.split(",") if x]
    if set(args.layouts) - set(LAYOUTS):
        ap.error(f"--layouts: of {', '.join(LAYOUTS)}, got {args.layouts}")
    return args


def main(argv: Sequence[str]) -> int:
    import torch

    args = parse_args(argv)
    if not args.cpu and (not torch.cuda.is_available() or torch.cuda.device_count() < 2):
        print("pp: needs 2 CUDA GPUs (device kind nvidia-h200-x2), nothing run; --cpu checks "
              "the script itself on the CPU")  # fmt: skip
        return 2
    prefill = _ints(args.prefill_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        setup = Setup(
            model_dir=_model_dir(Path(tmp), args.cpu, max((*prefill, args.context))),
            cuda=not args.cpu, prefill_tokens=prefill, batches=_ints(args.batches),
            context=args.context, repeats=args.repeats, micro_batches=args.micro_batches,
            serve_batches=_ints(args.serve_batches), serve_tokens=args.serve_tokens,
            graphs=args.graphs and not args.cpu,
        )  # fmt: skip
        results = {name: run_layout(name, setup) for name in args.layouts}
    return report(results)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _model_dir(tmp: Path, cpu: bool, max_len: int) -> str:
    """The tiny model (`cpu`), else a Llama-3-8B shape's config whose context holds
    `max_len` tokens (the 32k prompt is past the preset's 8192)."""
    from deploy.checkpoints.make_model import cached_tiny_model, make_model

    if cpu:
        return str(cached_tiny_model())
    length = max(8192, max_len)
    return str(
        make_model(
            tmp / "llama3-8b", preset="llama3-8b", config_only=True,
            max_position_embeddings=length,
        )
    )  # fmt: skip


def report(results: dict[str, dict[str, float] | str]) -> int:
    """Print one table (ms per step per layout, and each against one GPU); 1 if one failed."""
    status = 0
    timed = {k: v for k, v in results.items() if isinstance(v, dict)}
    for name, why in results.items():
        if isinstance(why, str):
            print(f"{name}: failed: {why}")
            status = 1
    if not timed:
        return 1
    steps = list(dict.fromkeys(step for times in timed.values() for step in times))
    base = timed.get("one")
    rows = []
    for step in steps:
        row = [step]
        for name in timed:
            if step not in timed[name]:  # (a PP=2 only row)
                row.append("-")
                continue
            ms = timed[name][step] * 1e3
            one = base.get(step) if base else None
            ratio = f" ({one / timed[name][step]:.2f}x)" if one and name != "one" else ""
            row.append(f"{ms:.2f}{ratio}")
        rows.append(tuple(row))
    header = ("step", *(f"{n} ms" for n in timed))
    print(Table.of(header, rows, "l" + "r" * len(timed)).plain())
    return status
