"""The whole engine step vs the decode it runs: how much host work stays on the critical path.

    python -m benchmarks engine_step          # GPU (one H200), Llama-3-8B shape
    python -m benchmarks engine_step --cpu    # CPU, tiny model
    (the same as `python -m benchmarks engine --engine-step [--cpu]`)

GPU (one H200): a Llama-3-8B-shaped model with random bf16 weights, flashinfer attention,
fused layer ops, CUDA graphs. For each batch size B, B requests enter decoding at once with
`context` tokens of KV each (reserved like a hand-off, `allocate_for_transfer` +
`add_transferred_request`, so no prefill is computed; the pool holds random values), greedy,
eos ignored. Then, side by side:
- pure decode: the captured CUDA graph of size B replayed back to back on the last staged
  inputs (device time only: no staging, no plan, no sampling, no host);
- `LLMEngine.step()` in a loop over that steady batch, with `overlap_scheduling` on and off
  (schedule, stage, plan, replay, sample, read the tokens, detokenize, stop checks, outputs);
  the ratio step / pure decode is the figure (goal <= 1.05 with overlap);
- a host profile of the same loop (a second run, with timers around each phase): schedule
  (`Scheduler.schedule`), launch (`ModelRunner.execute`: layout, staging, attention plan,
  graph replay queued), sample (`Sampler.sample`, queued), wait (`InflightStep.results`: the
  one wait on the device per step, the sampled-token sync), postprocess (the rest of reading
  a step: append, stop checks, detokenize, outputs) and other (the rest of step()). With
  overlap off, wait is the device time the host sits idle for; with overlap on, host work
  that still sits on the critical path shows as step time above pure decode.

CPU (`--cpu`): the same loop on the tiny model (float32, torch attention, one torch thread),
where the model runs synchronously inside `launch` (so overlap cannot hide anything); pure
decode is `ModelRunner.execute` of the same decode batch. It shows where the host time goes
and that the overlapped code path runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.cuda_timing import sync
from benchmarks.harness.decode_model import llama3_8b_folder, random_llama3_8b
from benchmarks.harness.steps import StepLog, run_steps
from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.overlap import InflightStep
from engine.modeling.llama import LlamaModel
from vocabulary.block_hash import hash_chain, hash_extra
from vocabulary.sampling import SamplingParams
from vocabulary.tokenizer import Tokenizer

PHASES = ("schedule", "launch", "sample", "wait", "postprocess", "other")


def start_decoding(engine: LLMEngine, batch_size: int, context: int, seed: int) -> None:
    """batch_size requests decoding at once, each over `context` tokens of (reserved, not
    computed) prompt KV: a hand-off without the transfer."""
    gen = torch.Generator().manual_seed(seed)
    vocab = min(engine.model_config.vocab_size, engine.tokenizer.vocab_size)  # text to detokenize
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    extra = hash_extra(engine.model_id)
    bs = engine.config.block_size
    for i in range(batch_size):
        prompt = torch.randint(1, vocab, (context,), generator=gen).tolist()
        rid = f"b{batch_size}-{seed}-{i}"
        engine.allocate_for_transfer(rid, prompt, hash_chain(prompt, bs, extra))
        engine.add_transferred_request(rid, int(prompt[-1]), params)


def stop_all(engine: LLMEngine) -> None:
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    engine.step()  # reads the step left in flight (its tokens are discarded)
    sync(engine.runner.device)
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def time_engine_steps(engine: LLMEngine, iters: int) -> float:
    """Seconds per `step()` over a steady batch, the device drained at both ends."""
    sync(engine.runner.device)
    t0 = time.perf_counter()
    for _ in range(iters):
        engine.step()
    sync(engine.runner.device)
    return (time.perf_counter() - t0) / iters


def time_pure_decode(engine: LLMEngine, iters: int, batch_size: int) -> float:
    """Seconds per decode of the steady batch without the engine: on CUDA the graph of size
    batch_size replayed back to back; on CPU `ModelRunner.execute` of the same decode."""
    graphs = engine.runner.graphs
    if graphs is not None:
        size = next(s for s in graphs.sizes if s >= batch_size)
        engine.step()  # stages a decode of this batch: the graph's inputs
        sync(engine.runner.device)
        t0 = time.perf_counter()
        for _ in range(iters):
            graphs.replay(size)
        sync(engine.runner.device)
        return (time.perf_counter() - t0) / iters
    from engine.batch import ScheduledBatch, SeqChunk

    bs = engine.config.block_size

    def newest(r: Any) -> SeqChunk:
        """A decode of the newest known token whose block is allocated: it rewrites that
        slot with the KV it holds (or is about to get), so the engine's state is unchanged."""
        p = r.num_tokens - 1 if (r.num_tokens - 1) // bs < len(r.block_ids) else r.num_tokens - 2
        return SeqChunk(r.request_id, (r.all_token_ids[p],), p, tuple(r.block_ids), True)

    batch = ScheduledBatch(tuple(newest(r) for r in engine.scheduler.running))
    t0 = time.perf_counter()
    for _ in range(iters):
        engine.runner.execute(batch)
    return (time.perf_counter() - t0) / iters


class HostProfile:
    """Wall time per phase of `LLMEngine.step()` (see the module docstring), by wrapping the
    calls each phase is made of; `restore()` unwraps them."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._results = InflightStep.results
        s = self

        def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    s.totals[name] += time.perf_counter() - t0

            return wrapper

        def results(step_: InflightStep) -> Any:
            return timed("wait", self._results)(step_)

        InflightStep.results = results  # type: ignore[method-assign,assignment]
        engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
        engine.runner.execute = timed("launch", engine.runner.execute)  # type: ignore[method-assign]
        engine.sampler.sample = timed("sample", engine.sampler.sample)  # type: ignore[method-assign]
        engine._complete = timed("postprocess", engine._complete)  # type: ignore[method-assign]

    def run(self, iters: int) -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            self.engine.step()
        sync(self.engine.runner.device)
        total = time.perf_counter() - t0
        self.steps += iters
        self.totals["postprocess"] -= self.totals["wait"]  # `_complete` includes the wait
        self.totals["other"] = total - sum(v for k, v in self.totals.items() if k != "other")
        return total / iters

    def restore(self) -> None:
        InflightStep.results = self._results  # type: ignore[method-assign]
        for obj, name in (
            (self.engine.scheduler, "schedule"),
            (self.engine.runner, "execute"),
            (self.engine.sampler, "sample"),
            (self.engine, "_complete"),
        ):
            del obj.__dict__[name]

    def per_step_us(self) -> dict[str, float]:
        return {k: v / self.steps * 1e6 for k, v in self.totals.items()}


def steps_needed(iters: int, rounds: int) -> int:
    """Decode steps `measure` runs per batch (each request's context grows by as many)."""
    return 2 * rounds * iters + iters + 16


def measure(
    log: StepLog,
    engines: dict[str, LLMEngine],
    batches: list[int],
    context: int,
    iters: int,
    rounds: int,
) -> None:
    """Per batch size: both engines decode the same batch; `rounds` rounds interleave timed
    runs of `iters` steps of each engine and of the pure decode (medians reported, so a
    noisy moment hits all three alike); then one profiled run of each engine."""
    results: dict[str, Any] = {}
    for b in batches:
        row: dict[str, Any] = {}
        for engine in engines.values():
            start_decoding(engine, b, context, seed=b)
            for _ in range(4):  # first plans, pinned buffers
                engine.step()
        samples: dict[str, list[float]] = {label: [] for label in (*engines, "decode")}
        for _ in range(rounds):
            for label, engine in engines.items():
                samples[label].append(time_engine_steps(engine, iters))
            samples["decode"].append(time_pure_decode(engines["overlap"], iters, b))
        for label, values in samples.items():
            key = "decode_ms" if label == "decode" else f"step_{label}_ms"
            row[key] = statistics.median(values) * 1e3
        for label, engine in engines.items():
            prof = HostProfile(engine)
            try:
                row[f"profiled_step_{label}_ms"] = prof.run(iters) * 1e3
            finally:
                prof.restore()
            row[f"host_{label}_us"] = prof.per_step_us()
            stop_all(engine)
        results[str(b)] = row
        decode = row["decode_ms"]
        print(f"   B={b}: pure decode {decode:.3f} ms", flush=True)
        for label in engines:
            ms = row[f"step_{label}_ms"]
            host = row[f"host_{label}_us"]
            parts = ", ".join(f"{k} {host[k]:.0f}" for k in PHASES)
            print(
                f"     step, {label:<10} {ms:.3f} ms = {ms / decode:.3f}x decode; host us: {parts}"
            )
            log.add(f"engine step B={b} {label}", f"{ms:.3f} ms", f"decode {decode:.3f} ms",
                    f"{ms / decode:.3f}x")  # fmt: skip
        for label in engines:
            host = row[f"host_{label}_us"]
            log.add(f"  host us B={b} {label}: sched/launch/sample, wait/post/other",
                    "/".join(f"{host[k]:.0f}" for k in PHASES[:3]),
                    "/".join(f"{host[k]:.0f}" for k in PHASES[3:]))  # fmt: skip
    print("   json: " + json.dumps(results))


def make_engines(
    model: LlamaModel, model_dir: Path, tokenizer: Tokenizer, config: EngineConfig
) -> dict[str, LLMEngine]:
    engines = {}
    for label, overlap in (("overlap", True), ("no-overlap", False)):
        engine = LLMEngine(replace(config, overlap_scheduling=overlap), model, tokenizer)
        if engine.runner.device.type == "cuda":
            engine.kv_cache.tensor.normal_()  # random KV (the graphs are captured already)
        print(
            f"   {label}: backend {engine.runner.attention_backend}, layer ops "
            f"{engine.runner.layer_ops.name}, graphs "
            f"{engine.runner.graphs.sizes if engine.runner.graphs else None}, "
            f"{engine.block_pool.num_blocks} blocks"
        )
        engines[label] = engine
    return engines


def gpu_engine_step(args: argparse.Namespace, log: StepLog) -> None:
    batches = [int(b) for b in args.step_batches.split(",")]
    context, bs = args.context, 16
    model = log.step("build Llama-3-8B-shaped model with random bf16 weights", random_llama3_8b)
    if model is None:
        return
    with llama3_8b_folder() as (folder, tokenizer):
        steps = steps_needed(args.iters, args.rounds)
        config = EngineConfig(
            model_dir=str(folder),
            model_id="llama3-8b-random",
            device="cuda",
            dtype="bfloat16",
            attention_backend="flashinfer",
            block_size=bs,
            num_kv_blocks=max(batches) * -(-(context + steps) // bs) + 16,
            max_num_seqs=max(batches),
            cuda_graph_max_batch=max(batches),
            max_model_len=context + steps + 64,
            enable_prefix_caching=False,
        )
        engines = log.step(
            "two engines, overlap on / off (each captures its CUDA graphs)",
            lambda: make_engines(model, folder, tokenizer, config),
        )
    if engines:
        log.step(
            f"engine step vs pure CUDA-graph decode, B={batches}, ctx {context}",
            lambda: measure(log, engines, batches, context, args.iters, args.rounds),
        )


def cpu_engine_step(args: argparse.Namespace, log: StepLog) -> None:
    from deploy.checkpoints.make_model import cached_tiny_model
    from engine.loading.loaders import load_model

    torch.set_num_threads(1)
    model_dir = cached_tiny_model()
    model = load_model(model_dir, torch.float32)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    batches = [int(b) for b in args.cpu_step_batches.split(",")]
    context = args.cpu_context
    steps = steps_needed(args.cpu_iters, args.rounds)
    config = EngineConfig(
        model_dir=str(model_dir),
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        num_kv_blocks=max(batches) * -(-(context + steps) // 16) + 16,
        max_num_seqs=max(batches),
        max_model_len=context + steps + 64,
        enable_prefix_caching=False,
        cuda_graphs=False,
    )
    engines = make_engines(model, model_dir, tokenizer, config)
    measure(log, engines, batches, context, args.cpu_iters, args.rounds)


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of this suite beyond the engine suite's --cpu, --context and --iters
    (which it shares: `python -m benchmarks engine --engine-step` runs this suite)."""
    parser.add_argument("--step-batches", default="1,8,16,64", help="engine-step batch sizes")
    parser.add_argument("--cpu-step-batches", default="1,8,16", help="... on the CPU")
    parser.add_argument("--cpu-context", type=int, default=256, help="... context on the CPU")
    parser.add_argument("--cpu-iters", type=int, default=20, help="... timed steps on the CPU")
    parser.add_argument("--rounds", type=int, default=5, help="engine-step: interleaved rounds")


def run(args: argparse.Namespace) -> None:
    """The suite, on the CPU with `args.cpu` or without CUDA, else on the GPU."""
    run_steps(
        args.cpu or not torch.cuda.is_available(),
        "CPU: engine step vs decode, tiny model",
        lambda log: cpu_engine_step(args, log),
        lambda log: gpu_engine_step(args, log),
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="CPU mode (tiny model)")
    parser.add_argument("--context", type=int, default=2048, help="decode context per sequence")
    parser.add_argument("--iters", type=int, default=30, help="timed decode steps")
    add_step_arguments(parser)
    run(parser.parse_args(argv))
