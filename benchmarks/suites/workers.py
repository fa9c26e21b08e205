"""Worker-actor benchmark on CPU: what the Ray actor path adds to the engine.

(i) Streaming overhead of the actor → caller path, in µs per token. The same prompts (corpus
    slices, greedy, eos ignored, fixed output length) run to completion three times per
    repetition, interleaved: on an `LLMEngine` in this process (stepped in a tight loop), and
    on a decode actor that prefills locally, through each of its two output paths:
    - stream: `generate(req)`, one Ray streaming call per request, one Ray item per request
      per engine step (the router's path before the token channels);
    - channel: `submit(req, channel_id)` + one `subscribe(channel_id)` stream for all of
      them, one Ray item per engine step, read here by the router's own `DecodeChannel`
      (router/decode_channel.py) and demultiplexed to per-request queues.
    Each request has its own asyncio consumer here in both paths. Both engines have the
    same config and one torch thread. Overhead = (actor wall time - in-process wall time) /
    generated tokens, median over the repetitions; run at several concurrencies. The CPU
    time this process (the caller, standing in for a router) and the actor process spent on
    each path is reported per token too (medians); the actor's includes its engine's
    compute, which is the same on both paths.

(ii) Hand-off latency: prefill done (the `prefill` result is back at the caller) → first
    decode step (the first chunk of the decode stream is back), one request at a time, over
    `--handoff-requests` requests after a warm-up (so the NIXL handshake is not counted).
    Split into `TokenChunk.transfer_s` (submit → transfer outcome on the decode worker,
    handshake excluded) and the rest (Ray calls, block allocation, joining the batch, one
    decode step, streaming back). Requests alternate between the two output paths of (i).
    For scale, one single-sequence decode step of the in-process engine is timed too.

    python -m benchmarks workers
    python -m benchmarks workers --concurrency 1,8,32 --handoff-requests 100
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Ray reads part of its environment when it is imported (deploy/control/local_ray.py)
for key, value in {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "UCX_TLS": "shm,tcp",
    "UCX_NET_DEVICES": "lo",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(key, value)

import ray  # noqa: E402
import torch  # noqa: E402

from benchmarks.harness.cluster import actor_pid  # noqa: E402
from benchmarks.harness.proc_stats import process_cpu_s  # noqa: E402
from benchmarks.harness.table import Table  # noqa: E402
from deploy.checkpoints.checkpoint_files import CORPUS  # noqa: E402
from deploy.checkpoints.make_model import cached_tiny_model  # noqa: E402
from deploy.control.worker_actors import start_worker_sync  # noqa: E402
from engine.config import EngineConfig, EngineMode  # noqa: E402
from engine.core.engine import LLMEngine  # noqa: E402
from kv_transfer.config import KVTransferConfig  # noqa: E402
from router.decode_channel import DecodeChannel  # noqa: E402
from vocabulary.decode_api import DecodeRequest, TokenChunk  # noqa: E402
from vocabulary.numeric import percentile  # noqa: E402
from vocabulary.prefill_api import PrefillRequest  # noqa: E402
from vocabulary.sampling import SamplingParams  # noqa: E402
from vocabulary.tokenizer import Tokenizer  # noqa: E402
from vocabulary.worker_api import ActorPlacement, WorkerRole  # noqa: E402
from worker_runtime.runtime import WorkerConfig  # noqa: E402


def engine_config(model_dir: Path, mode: EngineMode, num_kv_blocks: int) -> EngineConfig:
    return EngineConfig(
        model_dir=str(model_dir),
        mode=mode,
        device="cpu",
        dtype="float32",
        num_kv_blocks=num_kv_blocks,
        attention_backend="torch",
        cuda_graphs=False,
    )


def corpus_prompts(tok: Tokenizer, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """n corpus slices of lo..hi tokens, each starting with bos."""
    bos, *ids = tok.encode(CORPUS.read_text())
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(len(ids) - length)
        out.append([bos, *ids[start : start + length - 1]])
    return out


# ---- (i) streaming overhead -------------------------------------------------------------------


def run_local(engine: LLMEngine, prompts: list[list[int]], sp: SamplingParams, tag: str) -> float:
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, sp)
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - t0
    assert tokens == len(prompts) * sp.max_tokens, tokens
    return elapsed


@dataclass
class ActorRun:
    wall_s: float
    items: int
    """Ray items that carried the tokens (chunks on the stream path, batches on the channel)."""
    caller_cpu_s: float
    actor_cpu_s: float


async def run_stream(d: Any, prompts: list[list[int]], sp: SamplingParams, tag: str) -> int:
    """Every request on its own `generate` stream; returns the Ray items received."""

    async def one(i: int, p: list[int]) -> tuple[int, int]:
        req = DecodeRequest(f"{tag}-{i}", tuple(p), sp)
        tokens = chunks = 0
        async for ref in d.generate.options(num_returns="streaming").remote(req):
            chunk: TokenChunk = await ref
            tokens += len(chunk.token_ids)
            chunks += 1
        return tokens, chunks

    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    assert sum(t for t, _ in counts) == len(prompts) * sp.max_tokens
    return sum(c for _, c in counts)


async def run_channel(
    channel: DecodeChannel, prompts: list[list[int]], sp: SamplingParams, tag: str
) -> int:
    """Every request submitted on the caller's channel, read from its own queue (as the
    orchestrator does); returns the Ray items (batches) received meanwhile."""

    async def one(i: int, p: list[int]) -> int:
        rid = f"{tag}-{i}"
        stream = channel.open_request(rid)
        try:
            await stream.submit(DecodeRequest(rid, tuple(p), sp))
            tokens = 0
            while True:
                chunk = await stream.next()
                tokens += len(chunk.token_ids)
                if chunk.finish_reason is not None:
                    return tokens
        finally:
            stream.close()

    before = channel.num_batches
    tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    assert sum(tokens) == len(prompts) * sp.max_tokens
    return channel.num_batches - before


async def timed(path: Any, pid: int) -> ActorRun:
    """`path` awaited: its wall time, its items, this process's CPU and actor `pid`'s."""
    cpu0, actor0, t0 = time.process_time(), process_cpu_s(pid), time.perf_counter()
    items = await path
    wall = time.perf_counter() - t0
    return ActorRun(wall, items, time.process_time() - cpu0, process_cpu_s(pid) - actor0)


@dataclass
class OverheadRow:
    concurrency: int
    tokens: int
    local_s: float
    stream: ActorRun
    channel: ActorRun

    def us_per_token(self, run: ActorRun) -> float:
        return (run.wall_s - self.local_s) / self.tokens * 1e6


def median_run(runs: list[ActorRun]) -> ActorRun:
    return ActorRun(
        statistics.median(r.wall_s for r in runs),
        round(statistics.median(r.items for r in runs)),
        statistics.median(r.caller_cpu_s for r in runs),
        statistics.median(r.actor_cpu_s for r in runs),
    )


async def measure_overhead(
    d: Any, d_pid: int, engine: LLMEngine, prompts: list[list[int]], concurrency: int,
    max_tokens: int, repeat: int,
) -> OverheadRow:  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batch = prompts[:concurrency]
    # One channel per concurrency level, kept open across its repetitions (as a router keeps
    # one per decode worker).
    channel = DecodeChannel("bench-d0", d, f"bench-{uuid.uuid4().hex[:8]}")
    run_local(engine, batch, sp, f"warm-l{concurrency}")
    await run_stream(d, batch, sp, f"warm-s{concurrency}")
    await run_channel(channel, batch, sp, f"warm-c{concurrency}")
    local: list[float] = []
    stream: list[ActorRun] = []
    chan: list[ActorRun] = []
    for r in range(repeat):
        local.append(run_local(engine, batch, sp, f"l{concurrency}-{r}"))
        runs = [
            (stream, run_stream(d, batch, sp, f"s{concurrency}-{r}")),
            (chan, run_channel(channel, batch, sp, f"c{concurrency}-{r}")),
        ]
        for out, path in runs if r % 2 == 0 else runs[::-1]:  # alternate which goes first
            out.append(await timed(path, d_pid))
    channel.close("benchmark done")
    await channel.wait_closed()
    return OverheadRow(
        concurrency,
        concurrency * max_tokens,
        statistics.median(local),
        median_run(stream),
        median_run(chan),
    )


# ---- (ii) hand-off latency --------------------------------------------------------------------


@dataclass
class Handoff:
    path: str  # "stream" or "channel"
    total_s: float
    transfer_s: float
    num_tokens: int


async def one_handoff(
    p: Any, d: Any, channel: DecodeChannel | None, rid: str, prompt: list[int],
    sp: SamplingParams,
) -> Handoff:  # fmt: skip
    """Prefill on `p`, then decode on `d`: on `channel` if given, else on a `generate`
    stream; times prefill done → first decode chunk back here."""
    salt = rid  # no prefix reuse on either side: the whole prompt is pulled
    result = await p.prefill.remote(PrefillRequest(rid, tuple(prompt), sp, cache_salt=salt))
    done = time.perf_counter()  # prefill done: the result is back here
    assert result.handle is not None
    req = DecodeRequest(
        rid,
        tuple(prompt),
        sp,
        cache_salt=salt,
        handle=result.handle,
        first_token_id=result.first_token_id,
    )
    chunks: list[TokenChunk] = []
    if channel is None:
        async for ref in d.generate.options(num_returns="streaming").remote(req):
            chunks.append(await ref)
            if len(chunks) == 1:
                total = time.perf_counter() - done
    else:
        stream = channel.open_request(rid)
        try:
            await stream.submit(req)
            while not chunks or chunks[-1].finish_reason is None:
                chunks.append(await stream.next())
                if len(chunks) == 1:
                    total = time.perf_counter() - done
        finally:
            stream.close()
    first = chunks[0]
    assert first.token_ids
    path = "stream" if channel is None else "channel"
    return Handoff(path, total, first.transfer_s, first.num_transferred_tokens)


def decode_step_s(engine: LLMEngine, prompt: list[int], repeat: int = 20) -> float:
    """Median time of one single-sequence decode step of the in-process engine."""
    sp = SamplingParams(temperature=0.0, max_tokens=repeat + 2, ignore_eos=True)
    engine.add_request("step-probe", prompt, sp)
    engine.step()  # prefill
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,8", help="comma-separated request counts")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request in (i)")
    ap.add_argument("--repeat", type=int, default=5, help="interleaved repetitions in (i)")
    ap.add_argument("--handoff-requests", type=int, default=50)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--nice",
        type=int,
        default=15,
        help="niceness of this process (Ray starts workers at 15: both sides then compete "
        "for the CPU alike)",
    )
    args = ap.parse_args(argv)
    os.nice(args.nice - os.nice(0))
    levels = [int(c) for c in args.concurrency.split(",")]

    model_dir = cached_tiny_model()
    tok = Tokenizer.from_model_dir(model_dir)
    n = max(max(levels), args.handoff_requests + 1)
    prompts = corpus_prompts(tok, n, args.min_prompt, args.max_prompt, args.seed)

    torch.set_num_threads(1)  # as the actors (WorkerConfig.torch_threads)
    local = LLMEngine(engine_config(model_dir, EngineMode.COLOCATED, args.num_kv_blocks))

    ray.init(
        num_cpus=8,
        include_dashboard=False,
        object_store_memory=200 << 20,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    try:
        placement = ActorPlacement(num_cpus=0.25)
        transfer = KVTransferConfig()
        p, _ = start_worker_sync(
            WorkerConfig(
                "bench-p0",
                WorkerRole.PREFILL,
                engine_config(model_dir, EngineMode.PREFILL_ONLY, args.num_kv_blocks),
            ),
            transfer,
            placement,
        )
        d, _ = start_worker_sync(
            WorkerConfig(
                "bench-d0",
                WorkerRole.DECODE,
                engine_config(model_dir, EngineMode.COLOCATED, args.num_kv_blocks),
            ),
            transfer,
            placement,
        )

        d_pid = actor_pid(d)

        async def bench() -> tuple[list[OverheadRow], list[Handoff]]:
            rows = [
                await measure_overhead(d, d_pid, local, prompts, c, args.max_tokens, args.repeat)
                for c in levels
            ]
            sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            channel = DecodeChannel("bench-d0", d, f"bench-{uuid.uuid4().hex[:8]}")
            for warm in (None, channel):  # the handshake, and the channel's subscription
                await one_handoff(p, d, warm, f"handoff-warm-{warm is None}", prompts[-1], sp)
            handoffs = [
                await one_handoff(p, d, channel if i % 2 else None, f"handoff-{i}", prompts[i], sp)
                for i in range(args.handoff_requests)
            ]
            channel.close("benchmark done")
            return rows, handoffs

        rows, handoffs = asyncio.run(bench())
        step_s = decode_step_s(local, prompts[0])
    finally:
        ray.shutdown()

    load = os.getloadavg()[0]
    print(
        f"tiny model, CPU ({os.cpu_count()} cores, load average {load:.1f}), "
        f"one torch thread per engine, nice {os.nice(0)}\n"
    )
    print("(i) streaming overhead, actor -> caller (medians of interleaved repetitions)")
    header = ("requests", "tokens", "in-process s", "path", "actor s", "tokens/item",
              "overhead µs/tok", "caller CPU µs/tok", "actor CPU µs/tok")  # fmt: skip
    lines = [
        (f"{r.concurrency}", f"{r.tokens}", f"{r.local_s:.3f}", name, f"{run.wall_s:.3f}",
         f"{r.tokens / run.items:.2f}", f"{r.us_per_token(run):.0f}",
         f"{run.caller_cpu_s / r.tokens * 1e6:.0f}", f"{run.actor_cpu_s / r.tokens * 1e6:.0f}")
        for r in rows
        for name, run in (("stream", r.stream), ("channel", r.channel))
    ]  # fmt: skip
    print(Table.of(header, lines, "r" * len(header)).plain())
    print("\n(ii) hand-off latency, prefill done -> first decode chunk, requests one at a time")
    latencies: list[tuple[str, ...]] = []
    for path in ("stream", "channel"):
        hs = [h for h in handoffs if h.path == path]
        totals = [h.total_s * 1e3 for h in hs]
        transfers = [h.transfer_s * 1e3 for h in hs]
        rest = [t - x for t, x in zip(totals, transfers, strict=True)]
        for name, xs in (
            ("total", totals),
            ("transfer (transfer_s)", transfers),
            ("rest", rest),
        ):
            latencies.append((name, path, f"{len(xs)}", f"{percentile(xs, 50):.2f}",
                          f"{percentile(xs, 99):.2f}"))  # fmt: skip
    latencies.append(("one decode step, in-process", "", "", f"{step_s * 1e3:.2f}", ""))
    print(Table.of(("ms", "path", "n", "p50", "p99"), latencies).plain())
    toks = [h.num_tokens for h in handoffs]
    print(f"prompt tokens pulled per request: {min(toks)}-{max(toks)}")
