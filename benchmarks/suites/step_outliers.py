"""Engine steps far slower than their neighbours: every step timed, its phases and what it ran.

    python -m benchmarks step_outliers            # GPU, Llama-3-8B shape (dummy weights)
    python -m benchmarks step_outliers --cpu      # CPU, tiny model

An H100 profile showed decode steps of 45-116 ms among steady ones of 7.5-9.6 ms (issue 49):
steps in which sequences finished, and every step of a lone sequence after a burst of aborted
requests. This suite replays those sequences of calls on one engine, as `pdserve profile`
builds it (default `EngineConfig`: overlap scheduling, CUDA graphs, prefix caching), and
prints every step after the prompts are in:
- its wall time between two device syncs, the batch it ran (prefill tokens, decode rows),
  the requests running and waiting;
- its host phases (`engine_step.HostProfile`: schedule, launch, sample, wait, postprocess);
- on CUDA, what the caching allocator did in it (device allocations and frees, retries after
  emptying its cache), when anything;
- for a scenario with steps over `--outlier` x the steady scenario's median step (its own
  median can be the slow step: on the H100 every step of `finishing` but one was slow), a
  re-run under torch.profiler and the table of the ops that took the time, host and device.

Scenarios: `steady` (8 x 3072, none finishing), `finishing` (8 x 3072, max_tokens 7: they
finish one after another), `after_aborts` (64 x 3072 admitted, two steps, all aborted and
drained, then 1 x 3072 decoding), and `finishing_small` (32 x 256, max_tokens 4..12).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.cuda_timing import sync
from benchmarks.suites.engine_step import PHASES, HostProfile
from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from vocabulary.sampling import SamplingParams

ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms")


class StepRecorder:
    """Times single steps between device syncs, with their host phases and batch."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.prof = HostProfile(engine)
        self.last_batch: tuple[int, int] = (0, 0)
        schedule = self._profiled = engine.scheduler.schedule  # the HostProfile wrapper
        recorder = self

        def schedule_and_note() -> Any:
            out = schedule()
            chunks = out.batch.chunks
            decode = sum(1 for c in chunks if len(c.token_ids) == 1)
            recorder.last_batch = (sum(len(c.token_ids) for c in chunks) - decode, decode)
            return out

        engine.scheduler.schedule = schedule_and_note  # type: ignore[method-assign]

    def _allocator(self) -> dict[str, int]:
        """The CUDA caching allocator's counters: device allocations and frees it made, and
        allocations it retried after freeing its cache (a step near the memory limit)."""
        if self.engine.runner.device.type != "cuda":
            return {}
        stats = torch.cuda.memory_stats(self.engine.runner.device)
        return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS}

    def step(self, profiler: torch.profiler.profile | None = None) -> dict[str, Any]:
        e = self.engine
        before = dict(self.prof.totals)
        allocator = self._allocator()
        sync(e.runner.device)
        t0 = time.perf_counter()
        self.last_batch = (0, 0)
        outputs = e.step()
        sync(e.runner.device)
        wall = time.perf_counter() - t0
        if profiler is not None:
            profiler.step()
        phases = {k: (self.prof.totals[k] - before[k]) * 1e3 for k in PHASES if k != "other"}
        phases["postprocess"] -= phases["wait"]  # `_complete` includes the wait
        allocated = {k: v - allocator[k] for k, v in self._allocator().items()}
        return {
            "allocator": {k: v for k, v in allocated.items() if v},
            "ms": wall * 1e3,
            "prefill_tokens": self.last_batch[0],
            "decode_rows": self.last_batch[1],
            "running": len(e.scheduler.running),
            "waiting": len(e.scheduler.waiting),
            "finished": sum(1 for o in outputs if o.finished),
            "phases_ms": phases,
        }

    def restore(self) -> None:
        self.engine.scheduler.schedule = self._profiled  # type: ignore[method-assign]
        self.prof.restore()


def _prompt(rng: random.Random, engine: LLMEngine, n: int) -> list[int]:
    return [rng.randrange(2, engine.model_config.vocab_size) for _ in range(n)]


def _add(
    engine: LLMEngine, rng: random.Random, tag: str, n: int, ctx: int, mts: Sequence[int]
) -> list[str]:
    ids = []
    for i in range(n):
        rid = f"{tag}-{i}"
        params = SamplingParams(max_tokens=mts[i], ignore_eos=True)
        engine.add_request(rid, _prompt(rng, engine, ctx), params)
        ids.append(rid)
    return ids


def _prefill_all(rec: StepRecorder, ids: list[str]) -> None:
    """Steps until every request produced its first token (or ended)."""
    started: set[str] = set()
    e = rec.engine
    while len(started) < len(ids) and e.has_unfinished():
        started.update(o.request_id for o in e.step() if o.new_token_ids or o.finished)


def _timed(rec: StepRecorder, steps: int | None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    while rec.engine.has_unfinished() and (steps is None or len(rows) < steps):
        rows.append(rec.step())
    return rows


def scenarios(
    rec: StepRecorder, ctx: int, small_ctx: int, abort_burst: int
) -> dict[str, list[dict[str, Any]]]:
    e = rec.engine
    rng = random.Random(0)
    out: dict[str, list[dict[str, Any]]] = {}
    budget = e.config.max_num_batched_tokens
    # steady: enough tokens that none finishes while the later ones prefill or while timed
    ids = _add(e, rng, "steady", 8, ctx, [-(-8 * ctx // budget) + 20] * 8)
    _prefill_all(rec, ids)
    out["steady"] = _timed(rec, 10)
    for rid in ids:
        e.abort_request(rid)
    _timed(rec, None)
    ids = _add(e, rng, "finishing", 8, ctx, [7] * 8)
    _prefill_all(rec, ids)
    out["finishing"] = _timed(rec, None)
    ids = _add(e, rng, "burst", abort_burst, ctx, [64] * abort_burst)
    for _ in range(2):
        e.step()
    for rid in ids:
        e.abort_request(rid)
    out["abort_drain"] = _timed(rec, None)
    ids = _add(e, rng, "after-aborts", 1, ctx, [40])
    _prefill_all(rec, ids)
    out["after_aborts"] = _timed(rec, None)
    ids = _add(e, rng, "small", 32, small_ctx, [4 + i % 9 for i in range(32)])
    _prefill_all(rec, ids)
    out["finishing_small"] = _timed(rec, None)
    return out


def profile_outliers(
    rec: StepRecorder,
    name: str,
    rows: list[dict[str, Any]],
    limit_ms: float,
    ctx: int,
    small_ctx: int,
) -> str:
    """Re-run one scenario under torch.profiler when a step of it took over `limit_ms`."""
    if not any(r["ms"] > limit_ms for r in rows):
        return ""
    e = rec.engine
    rng = random.Random(1)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if e.runner.device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    if name == "after_aborts":
        ids = _add(e, rng, "p-burst", 64, ctx, [64] * 64)
        e.step()
        e.step()
        for rid in ids:
            e.abort_request(rid)
        _timed(rec, None)
        ids = _add(e, rng, "p-after", 1, ctx, [12])
    elif name == "finishing_small":
        ids = _add(e, rng, "p-small", 32, small_ctx, [4 + i % 9 for i in range(32)])
    else:
        ids = _add(e, rng, "p-fin", 8, ctx, [7] * 8)
    _prefill_all(rec, ids)
    with torch.profiler.profile(activities=acts) as prof:
        prof_rows = _timed(rec, None)
    sort = "cuda_time_total" if len(acts) > 1 else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=25)
    cpu_table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=15)
    steps = ", ".join(f"{r['ms']:.1f}" for r in prof_rows)
    return f"profiled re-run of {name}: steps {steps} ms\n{table}\n{cpu_table}"


def build_engine(cpu: bool, model_dir: Path | None, host_kv_gb: float = -1.0) -> LLMEngine:
    if cpu:
        from deploy.checkpoints.make_model import cached_tiny_model

        torch.set_num_threads(1)
        return LLMEngine(
            EngineConfig(
                model_dir=str(cached_tiny_model()), device="cpu", dtype="float32",
                num_kv_blocks=4096, attention_backend="torch", cuda_graphs=False,
            )
        )  # fmt: skip
    assert model_dir is not None
    return LLMEngine(
        EngineConfig(
            model_dir=str(model_dir), device="cuda", dtype="bfloat16", load_format="dummy",
            num_kv_blocks=0, attention_backend="auto", cuda_graphs=True, host_kv_gb=host_kv_gb,
        )
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int | None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="CPU, the tiny model")
    parser.add_argument("--model", type=Path, help="GPU: model folder (config.json; dummy weights)")
    parser.add_argument("--context", type=int, default=0, help="long prompts (GPU 3072, CPU 400)")
    parser.add_argument(
        "--outlier", type=float, default=3.0, help="outlier: x the steady scenario's median"
    )
    parser.add_argument("--json", type=Path, help="write every step here")
    parser.add_argument(
        "--host-kv-gb", type=float, default=-1.0,
        help="GPU: EngineConfig.host_kv_gb (-1 its default, 0 the host KV tier off)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    cpu = args.cpu or not torch.cuda.is_available()
    if not cpu and args.model is None:
        parser.error("--model is needed on the GPU")
    ctx = args.context or (400 if cpu else 3072)
    engine = build_engine(cpu, args.model, args.host_kv_gb)
    rec = StepRecorder(engine)
    try:
        small_ctx = 64 if cpu else 256
        found = scenarios(rec, ctx, small_ctx, 16 if cpu else 64)
        report: dict[str, Any] = {"scenarios": found, "profiles": {}}
        limit_ms = args.outlier * statistics.median(r["ms"] for r in found["steady"])
        for name, rows in found.items():
            if not rows:
                continue
            med = statistics.median(r["ms"] for r in rows)
            print(f"== {name}: {len(rows)} steps, median {med:.2f} ms")
            for i, r in enumerate(rows):
                mark = "  <-- outlier" if r["ms"] > limit_ms else ""
                ph = " ".join(f"{k} {v:.1f}" for k, v in r["phases_ms"].items())
                print(
                    f"  {i:3d} {r['ms']:8.2f} ms  prefill {r['prefill_tokens']:5d} decode "
                    f"{r['decode_rows']:3d} run {r['running']:3d} wait {r['waiting']:3d} "
                    f"fin {r['finished']}  [{ph}]{r['allocator'] or ''}{mark}"
                )
        for name in ("finishing", "after_aborts", "finishing_small"):
            text = profile_outliers(rec, name, found[name], limit_ms, ctx, small_ctx)
            if text:
                report["profiles"][name] = text
                print(text)
    finally:
        rec.restore()
        engine.close()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return None
