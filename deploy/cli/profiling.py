"""`pdserve profile`: one worker's engine (an `LLMEngine` in this process) timed through a grid,
written as a `planner/perf_profile.py:PerfProfile`.

- prefill: one step computing N prompt tokens (N up to `max_num_batched_tokens`), fresh random
  prompts so nothing is cached; and, at a few points, the same N behind a cached prefix;
- decode: B sequences of C context tokens each, prefilled first, then a few decode steps timed;
- hand-off: not measured here (it needs two workers and NIXL); a constant from the
  configuration (`--handoff-ms`, default from docs/benchmarks.md, "Workers": prefill done →
  first decode chunk at the caller on CPU).

Each point is the median of `reps` timed steps. The engine runs with the worker's
`torch_threads` (1 by default: workers share the cores), so the times are those a worker sees
when it has a core to itself. A tensor-parallel engine (`tensor_parallel_size` N > 1) is
profiled whole: rank 0 here, ranks 1..N-1 following its steps in processes of their own
(deploy/cli/profile_ranks.py; on CPU each with those threads, on CUDA rank r on device r),
so a step's time includes its all-reduces.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from planner.perf_profile import (
    DecodePoint,
    HandoffCost,
    PerfProfile,
    PrefillPoint,
    ProfileHeader,
)

DEFAULT_HANDOFF_MS = 12.0
"""CPU, tiny model: prefill done → first decode chunk at the caller, p50 (docs/benchmarks.md,
"Workers", [workers]: 11.7-18.9 ms, of which the transfer itself 1.6-4.0 ms)."""


@dataclass(frozen=True)
class ProfileGrid:
    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 512, 1024, 2048)
    cached_prefix: tuple[tuple[int, int], ...] = ((128, 512),)
    """(new tokens, cached tokens) points."""
    decode_batch: tuple[int, ...] = (1, 4, 16, 32)
    decode_context: tuple[int, ...] = (64, 256, 1024)
    reps: int = 3

    @classmethod
    def gpu(cls) -> ProfileGrid:
        """A serving GPU's range: prompt chunks up to 8192 tokens, decode batches to 128 at
        contexts to 3072 (points past the pool or the token budget are skipped; each decode
        point prefills its batch first: ~1M tokens in all, ~1-2 min for the 8B shape)."""
        return cls(
            (64, 256, 512, 1024, 2048, 4096, 8192), ((512, 2048),),
            (1, 8, 32, 64, 128), (256, 1024, 3072), 3,
        )  # fmt: skip

    @classmethod
    def quick(cls) -> ProfileGrid:
        """A few points (the integration test)."""
        return cls((16, 128), ((32, 64),), (1, 4), (32, 128), 2)


def measure(
    model_dir: Path,
    grid: ProfileGrid,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    num_kv_blocks: int = 4096,
    torch_threads: int = 1,
    handoff_ms: float = DEFAULT_HANDOFF_MS,
    load_format: str = "auto",
    tensor_parallel_size: int = 1,
    say: Callable[[str], None] = lambda _: None,
) -> PerfProfile:
    """Time an engine of `tensor_parallel_size` ranks through `grid`: rank 0 in this
    process, the others as processes of this machine (deploy/cli/profile_ranks.py), stopped
    before this returns or raises."""
    import torch

    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine

    if device == "cpu":
        torch.set_num_threads(max(1, torch_threads))
    config = EngineConfig(
        model_dir=str(model_dir),
        device=device,
        dtype=dtype,
        num_kv_blocks=num_kv_blocks if device == "cpu" else 0,
        attention_backend="torch" if device == "cpu" else "auto",
        cuda_graphs=device != "cpu",
        load_format=load_format,
        tensor_parallel_size=tensor_parallel_size,
    )
    if tensor_parallel_size == 1:
        engine = LLMEngine(config)
        try:
            return _measure_engine(engine, grid, handoff_ms, say)
        finally:
            engine.close()
    from deploy.cli.profile_ranks import FollowerRanks

    ranks = FollowerRanks(config, torch_threads)
    try:
        with ranks:
            engine = LLMEngine(config, tp=ranks.join())
            try:
                return _measure_engine(engine, grid, handoff_ms, say)
            finally:
                engine.close()
    except Exception as e:
        followers = ranks.failures()
        if followers:
            raise RuntimeError(f"{e}\n{followers}") from e
        raise


def _measure_engine(
    engine: object, grid: ProfileGrid, handoff_ms: float, say: Callable[[str], None]
) -> PerfProfile:
    import torch

    from engine.core.engine import LLMEngine

    assert isinstance(engine, LLMEngine)
    config = engine.config
    timer = _Timer(engine, random.Random(0))
    budget = config.max_num_batched_tokens
    prefill = []
    for n in grid.prefill_tokens:
        if n <= budget:
            prefill.append(PrefillPoint(n, timer.prefill(n, 0, grid.reps)))
            say(f"prefill {n} tokens: {prefill[-1].step_s * 1000:.2f} ms")
    for n, cached in grid.cached_prefix:
        if n <= budget:
            prefill.append(PrefillPoint(n, timer.prefill(n, cached, grid.reps), cached))
            say(f"prefill {n} behind {cached} cached: {prefill[-1].step_s * 1000:.2f} ms")
    decode = []
    for c in grid.decode_context:
        for b in grid.decode_batch:
            if b * (c + grid.reps + 2) > engine.block_pool.num_free * config.block_size:
                continue
            decode.append(DecodePoint(b, c, timer.decode(b, c, grid.reps)))
            say(f"decode {b} x {c}: {decode[-1].step_s * 1000:.2f} ms")
    mc = engine.model_config
    on_cpu = config.device == "cpu"
    header = ProfileHeader(
        model_id=engine.model_id,
        num_layers=mc.num_layers,
        hidden_size=mc.hidden_size,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        vocab_size=mc.vocab_size,
        dtype=str(engine.kv_cache.tensor.dtype).removeprefix("torch."),
        tensor_parallel_size=config.tensor_parallel_size,
        device="cpu" if on_cpu else torch.cuda.get_device_name(),
        block_size=config.block_size,
        num_kv_blocks=engine.block_pool.num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=config.max_num_seqs,
        pdserve_version=_pdserve_version(),
        torch_version=torch.__version__,
        torch_threads=torch.get_num_threads() if on_cpu else 0,
    )
    handoff = HandoffCost(
        fixed_s=handoff_ms / 1000.0,
        source="constant (--handoff-ms; docs/benchmarks.md, Workers)",
    )
    return PerfProfile(header, tuple(prefill), tuple(decode), handoff)


class _Timer:
    def __init__(self, engine: object, rng: random.Random) -> None:
        from engine.core.engine import LLMEngine

        assert isinstance(engine, LLMEngine)
        self.engine = engine
        self.rng = rng
        self.count = 0

    def _prompt(self, n: int) -> list[int]:
        high = self.engine.model_config.vocab_size
        return [self.rng.randrange(2, high) for _ in range(n)]

    def _add(self, prompt: Sequence[int], max_tokens: int) -> str:
        from vocabulary.sampling import SamplingParams

        self.count += 1
        request_id = f"profile-{self.count}"
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(request_id, prompt, params)
        return request_id

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def prefill(self, n: int, cached: int, reps: int) -> float:
        times = []
        for _ in range(reps + 1):  # the first is a warm-up
            prefix = self._prompt(cached)
            if cached:
                self._add(prefix, 1)
                self._drain()
            self._add(prefix + self._prompt(n), 1)
            t0 = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - t0)
            self._drain()
        return statistics.median(times[1:])

    def decode(self, batch: int, context: int, reps: int) -> float:
        # No sequence may finish inside the timed steps (a step that ends requests is not the
        # steady decode step; on an H100 such steps took 45-95 ms against 9): the first ones
        # decode while the later ones prefill, one token a step, so they get that many more.
        budget = self.engine.config.max_num_batched_tokens
        max_tokens = -(-batch * context // budget) + reps + 6
        ids = [self._add(self._prompt(context), max_tokens) for _ in range(batch)]
        started: set[str] = set()
        while len(started) < batch:  # prefill every sequence (and one decode step)
            started.update(o.request_id for o in self.engine.step() if o.new_token_ids)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - t0)
        for request_id in ids:
            self.engine.abort_request(request_id)
        self._drain()
        return statistics.median(times[1:])


def _pdserve_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "unknown"
