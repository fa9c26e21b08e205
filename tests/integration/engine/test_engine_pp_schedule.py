"""The cross-step pipeline schedule on CPU (engine/core/decode_groups.py, engine/core/pp_steps.py):
the tiny model cut into 2 and 4 stages, real processes over gloo.

- requests arriving at different steps and finishing at different lengths, one aborted while
  its step is in flight, give transformers' greedy tokens, with G steps in flight at once and
  every block free at the end; a pool small enough to preempt gives them too;
- the step trace: with every stage paced (a sleep in each micro-batch, so the trace does not
  hang on how a loaded machine schedules the processes), no stage is idle for long while
  another works in steady decoding, a bound the within-step schedule at one micro-batch
  misses by far (the same measure, asserted above the bound for it).
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any

import pytest
from engine_factories import greedy
from pp_ranks import PPRanks, pp_size
from references import Reference
from test_engine_pp import pp_config

from engine.config import EngineConfig
from engine.core.pp_runner import StageSpan

ARRIVALS = ((0, 0, 12), (0, 1, 5), (0, 2, 9), (2, 3, 16), (4, 4, 3), (7, 5, 11), (9, 6, 7),
            (15, 7, 14))  # fmt: skip
"""(step at which it is added, prompt index, max_tokens)."""


def staggered(prompts: list[list[int]], engine: Any, conn: Any) -> dict[str, Any]:
    """On rank 0: the requests of ARRIVALS added at their steps, and "x" (prompt 2, 40
    tokens) aborted at step 10 or the first after it at which its step is in flight. Tokens
    per request, the most steps that were in flight at once, whether every block is free at
    the end, the preemptions and whether "x" was aborted in flight."""
    tokens: dict[str, list[int]] = {}
    pending = sorted(ARRIVALS)
    engine.add_request("x", prompts[2], greedy(40))
    step, aborted = 0, False
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, i, n = pending.pop(0)
            engine.add_request(f"p{i}", prompts[i], greedy(n))
        x = engine.scheduler.requests.get("x")
        if step >= 10 and x is not None and x.num_output_placeholders:
            aborted = engine.abort_request("x")
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    pool = engine.block_pool
    return {
        "tokens": tokens,
        "max_in_flight": engine.pipelined.max_in_flight if engine.pipelined else 0,
        "free_at_end": pool.num_free == pool.num_blocks,
        "preemptions": engine.scheduler.num_preemptions,
        "aborted": aborted,
    }


def run_ranks(config: EngineConfig, scenario: Any, **kw: Any) -> list[Any]:
    ranks = PPRanks(pp_size(config), config, scenario, **kw)
    try:
        results = ranks.start().results(timeout_s=180)
    finally:
        ranks.stop()
    assert all(status == "ok" for status, _ in results), results
    return results


@pytest.mark.parametrize(("stages", "blocks"), [(2, 128), (4, 128), (2, 10)])
def test_cross_step_schedule_gives_transformers_tokens_as_requests_come_and_go(
    tiny_model_dir: Path,
    prompts: list[list[int]],
    hf_greedy: Reference,
    stages: int,
    blocks: int,
) -> None:
    """(2, 10): a 10-block pool, so decodes preempt others, some of them in flight."""
    config = pp_config(tiny_model_dir, stages, num_kv_blocks=blocks)
    assert config.pipeline_schedule == "cross_step" and config.cross_step_pipeline
    results = run_ranks(config, functools.partial(staggered, prompts))
    got, _ = results[0][1]
    for _, i, n in ARRIVALS:
        assert got["tokens"][f"p{i}"] == hf_greedy(prompts[i], n), f"prompt {i}"
    assert got["aborted"]
    x = got["tokens"].get("x", [])
    assert len(x) < 40 and x == hf_greedy(prompts[2], 40)[: len(x)]
    assert got["max_in_flight"] == stages  # G = S groups were in flight at once
    assert got["free_at_end"]
    if blocks < 128:
        assert got["preemptions"] > 0


def decode_burst(prompts: list[list[int]], engine: Any, conn: Any) -> list[list[int]]:
    return engine.generate(prompts, greedy(16))


def idle_while_others_busy(stages: list[list[StageSpan]]) -> list[float]:
    """Per stage, the fraction of steady decoding (the middle half of the time from the
    first decode-only span to the last) in which it ran nothing while another stage ran a
    micro-batch."""
    decode = [s for spans in stages for s in spans if s.num_tokens == s.num_seqs]
    first, last = min(s.start for s in decode), max(s.end for s in decode)
    t0, t1 = first + 0.25 * (last - first), first + 0.75 * (last - first)
    cuts = sorted({t0, t1, *(t for spans in stages for s in spans for t in (s.start, s.end))})
    cuts = [t for t in cuts if t0 <= t <= t1]
    out = []
    for k in range(len(stages)):
        idle = 0.0
        for a, b in itertools.pairwise(cuts):
            mid = (a + b) / 2
            busy = [any(s.start <= mid < s.end for s in spans) for spans in stages]
            if not busy[k] and any(busy):
                idle += b - a
        out.append(idle / (t1 - t0))
    return out


BOUND = 0.25
"""Most of steady decoding a stage may sit idle while another works (cross-step)."""


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", ["cross_step", "within_step"])
def test_step_trace_cross_step_keeps_every_stage_busy_in_steady_decode(
    tiny_model_dir: Path,
    prompts: list[list[int]],
    hf_greedy: Reference,
    stages: int,
    schedule: str,
) -> None:
    """Eight requests decode 16 tokens, every stage sleeping 40 ms in each micro-batch. The
    cross-step schedule keeps each stage idle-while-another-works under BOUND of the time;
    the within-step schedule at one micro-batch a step runs one stage at a time (idle about
    (S - 1) / S of it), so this measure fails it."""
    config = pp_config(
        tiny_model_dir, stages, max_num_batched_tokens=512, pipeline_schedule=schedule,
        pipeline_micro_batches=1 if schedule == "within_step" else 0,
    )  # fmt: skip
    results = run_ranks(config, functools.partial(decode_burst, prompts), slow=(-1, 0.04))
    tokens, spans0 = results[0][1]
    for prompt, got in zip(prompts, tokens, strict=True):
        assert got == hf_greedy(prompt, 16)
    spans = [spans0] + [r[1][1] for r in results[1:]]
    assert [{s.stage for s in stage} for stage in spans] == [{k} for k in range(stages)]
    idle = idle_while_others_busy(spans)
    if schedule == "cross_step":
        assert max(idle) < BOUND, idle
    else:
        assert min(idle) > 0.4 * (stages - 1) / stages + 0.1 > BOUND, idle
