"""Pipeline parallelism on CPU: the tiny model (4 layers) cut into 2 stages (and 2 stages of 2
TP ranks; 4 stages in test_engine_pp_features.py) in real processes over gloo gives
transformers' greedy tokens; a step's micro-batches keep both stages busy at once (the step
trace); abort frees every block and a migrated request continues exactly; a stage that dies or
fails mid-step fails rank 0's step at once (no hang).

Tokens are compared exactly: a stage passes the pair (h, residual) on, so the arithmetic is
the whole model's, and a prompt chunk cut into micro-batches reads its earlier pieces' KV as
a chunked prefill does (the tiny model's greedy choices have clear margins).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from cpu_engine import cpu_engine
from engine_factories import greedy
from pp_ranks import PPRanks, pp_size
from references import Reference
from tp_ranks import generate_rounds, step_after_kill, step_until_error

from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.pp_runner import StageSpan
from engine.modeling.llama import LlamaModel
from vocabulary.sampling import SamplingParams
from vocabulary.tokenizer import Tokenizer


def pp_config(model_dir: Path, stages: int, tp: int = 1, **fields: Any) -> EngineConfig:
    """Chunked prefill (32-token steps: the long prompts take 2 chunks), 128 blocks."""
    fields = {"max_num_batched_tokens": 32, "num_kv_blocks": 128, **fields}
    return cpu_engine(
        model_dir, block_size=16, pipeline_parallel_size=stages, tensor_parallel_size=tp,
        tp_timeout_s=20.0, **fields,
    )  # fmt: skip


def run_ranks(config: EngineConfig, scenario: Any, timeout_s: float = 120, **kw: Any) -> list[Any]:
    ranks = PPRanks(pp_size(config), config, scenario, **kw)
    try:
        return ranks.start().results(timeout_s=timeout_s)
    finally:
        ranks.stop()


@pytest.mark.parametrize(
    ("stages", "tp", "schedule"),
    [(2, 1, "cross_step"), (2, 2, "cross_step"), (2, 1, "within_step")],
)
def test_pp_greedy_tokens_match_transformers_and_one_rank(
    tiny_model_dir: Path,
    tiny_model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    hf_greedy: Reference,
    stages: int,
    tp: int,
    schedule: str,
) -> None:
    """Eight prompts in one batch, chunked, twice (the second round hits the prefix cache);
    every rank's pool holds its stage's layers of its TP part, with the same block count. (4
    stages: test_engine_pp_features.py, whose 4 ranks run this scenario before another.)
    Within a step the batches are one rank's, so the prefix reuse is one rank's too."""
    config = pp_config(tiny_model_dir, stages, tp, pipeline_schedule=schedule)
    results = run_ranks(config, functools.partial(generate_rounds, prompts, greedy(10), 2))
    check_greedy_rounds(results, config, prompts, hf_greedy, tiny_model, tokenizer)


def check_greedy_rounds(
    results: list[Any],
    config: EngineConfig,
    prompts: list[list[int]],
    hf_greedy: Reference,
    tiny_model: LlamaModel,
    tokenizer: Tokenizer,
) -> None:
    """What `generate_rounds` on every rank of a pipeline of `config` must give (the test
    above)."""
    stages, tp = config.pipeline_parallel_size, config.tensor_parallel_size
    assert all(status == "ok" for status, _ in results), results
    got, _ = results[0][1]
    for i, prompt in enumerate(prompts):
        assert got["rounds"][0][i][0] == hf_greedy(prompt, 10), f"prompt {i}"
    one = LLMEngine(
        replace(config, pipeline_parallel_size=1, tensor_parallel_size=1),
        model=tiny_model,
        tokenizer=tokenizer,
    )
    want = generate_rounds(prompts, greedy(10), 2, one, None)["rounds"]
    if not config.cross_step_pipeline:
        assert got["rounds"] == want
    else:  # other steps admit the prompts: the tokens are one rank's, and prefix reuse at
        # least (a step's blocks are cached once it is launched, engine/core/pp_steps.py)
        assert [[t for t, _ in r] for r in got["rounds"]] == [[t for t, _ in r] for r in want]
        for r, w in zip(got["rounds"], want, strict=True):
            assert all(g >= c for (_, g), (_, c) in zip(r, w, strict=True)), (r, w)
    per_stage = 4 // stages
    specs = [got["spec"]] + [spec for _, (_, _, spec, _) in results[1:]]
    for rank, spec in enumerate(specs):
        stage = rank // tp
        assert (spec.pp_size, spec.pp_rank, spec.layer_start, spec.num_layers) == (
            stages, stage, stage * per_stage, per_stage
        )  # fmt: skip
        assert (spec.model_layers, spec.tp_size, spec.tp_rank) == (4, tp, rank % tp)
        assert spec.num_blocks == 128
    assert all(steps > 0 for _, (steps, *_) in results[1:])  # every rank ran, returned on close


def prefill_one(prompt: list[int], engine: Any, conn: Any) -> list[int]:
    return engine.generate([prompt], greedy(4))[0]


@pytest.mark.parametrize("slow_stage", [0, 1])
def test_micro_batches_keep_both_stages_busy(
    tiny_model_dir: Path, tokenizer: Tokenizer, hf_greedy: Reference, slow_stage: int
) -> None:
    """The schedule of engine/core/pp_runner.py on a 192-token prompt cut into 4 micro-batches
    of 48 tokens, one stage made 200 ms slower per micro-batch (so the trace does not hang on
    how a loaded machine schedules the processes): each stage runs the micro-batches in order,
    stage 1 starts micro-batch k only after stage 0 ended it, and the stages work at once:
    with stage 1 slow, stage 0 runs all four before stage 1 ends its first (it never waits for
    the next stage); with stage 0 slow, stage 1 ends some k before stage 0 ends k + 1, while
    stage 0 runs."""
    text = "The river runs past the old mill and under the stone bridge. " * 12
    prompt = tokenizer.encode(text)[:192]
    assert len(prompt) == 192
    config = pp_config(tiny_model_dir, 2, max_num_batched_tokens=256, pipeline_micro_batches=4)
    scenario = functools.partial(prefill_one, prompt)
    leader, follower = run_ranks(config, scenario, slow=(slow_stage, 0.2))
    assert leader[0] == "ok" and follower[0] == "ok", (leader, follower)
    tokens, stage0 = leader[1]
    _, stage1, *_ = follower[1]
    assert tokens == hf_greedy(prompt, 4)
    first = [s for s in stage0 if s.step == 1], [s for s in stage1 if s.step == 1]
    assert [s.micro_batch for s in first[0]] == [s.micro_batch for s in first[1]] == [0, 1, 2, 3]
    assert {s.stage for s in first[0]} == {0} and {s.stage for s in first[1]} == {1}
    for a, b in zip(*first, strict=True):
        assert b.start >= a.end  # stage 1 runs k after stage 0 handed it over
    if slow_stage == 1:
        # (stage 0's four take a few ms together: stage 1 may start its first after they end
        # on a loaded machine, so no overlap is asserted here, only that stage 0 never waited)
        assert first[0][-1].end < first[1][0].end, first
    else:
        # (each k's pair within 200 ms, but a loaded machine may deschedule a rank that long)
        assert any(b.end < a.end for a, b in zip(first[0][1:], first[1][:-1], strict=True))
        assert sum(overlap(a, b) for a in first[0] for b in first[1]) > 0, first


def overlap(a: StageSpan, b: StageSpan) -> float:
    """Seconds both spans were running."""
    return max(0.0, min(a.end, b.end) - max(a.start, b.start))


def test_killed_stage_fails_rank0_next_step_within_deadline(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    config = pp_config(tiny_model_dir, 2)
    ranks = PPRanks(2, config, functools.partial(step_after_kill, prompts[0], greedy(50)))
    ranks.start()
    try:
        assert ranks.recv(1, timeout_s=60) == "built"
        assert ranks.recv(0, timeout_s=60) == "ready"
        ranks.kill(1)
        ranks.pipes[0].send("killed")
        ((status, ((elapsed, error, message), _)),) = ranks.results(timeout_s=30, ranks=(0,))
    finally:
        ranks.stop()
    assert status == "ok"
    assert error == "TPGroupError", message
    assert "TP group broken" in message
    assert elapsed < config.tp_timeout_s


def test_stage_failing_mid_step_fails_every_rank(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    """Stage 1 (of 4) raises in a step: it breaks the group at once, so rank 0 (waiting for
    the last stage's logits) and the other stages fail too, well within the deadline."""
    config = pp_config(tiny_model_dir, 4)
    scenario = functools.partial(step_until_error, prompts[0], greedy(50))
    results = run_ranks(config, scenario, timeout_s=90, fault_rank=1)
    status, ((elapsed, error, message), _) = results[0]
    assert status == "ok"
    assert error == "TPGroupError", message
    assert elapsed < config.tp_timeout_s
    assert results[1][0] == "error" and "injected fault in a pipeline stage" in results[1][1]
    assert all(r[0] == "error" and "TP group broken" in r[1] for r in results[2:]), results


def abort_then_migrate(prompts: list[list[int]], engine: Any, conn: Any) -> dict[str, Any]:
    """On rank 0 of a pipeline engine: three requests, one aborted mid-decode (its blocks
    back at once); then a request migrated after 5 tokens (its prior prefilled after the
    prompt) and a seeded one. Every block is free at the end: the books are rank 0's, and
    the block ids are the same on every stage."""
    from vocabulary.engine_io import PriorOutput

    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"a{i}", p, greedy(20))
    for _ in range(6):
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    used = engine.block_pool.num_blocks - engine.block_pool.num_free
    engine.abort_request("a1")
    freed = engine.block_pool.num_free - (engine.block_pool.num_blocks - used)
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    whole = engine.generate([prompts[2]], greedy(12))[0]
    engine.add_request("moved", prompts[2], greedy(12), prior=PriorOutput(tuple(whole[:5]), 0))
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    seeded = SamplingParams(temperature=1.0, top_k=40, seed=7, max_tokens=10, ignore_eos=True)
    sampled = engine.generate([prompts[3]], seeded)[0]
    return {
        "freed": freed,
        "tokens": tokens,
        "whole": whole,
        "sampled": sampled,
        "free_at_end": engine.block_pool.num_free == engine.block_pool.num_blocks,
    }


def test_abort_and_migration_on_a_pp_engine_free_every_block_and_continue_exactly(
    tiny_model_dir: Path,
    tiny_model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    hf_greedy: Reference,
) -> None:
    config = pp_config(tiny_model_dir, 2)
    leader, follower = run_ranks(config, functools.partial(abort_then_migrate, prompts))
    assert leader[0] == "ok" and follower[0] == "ok", (leader, follower)
    got, _ = leader[1]
    assert got["freed"] > 0 and got["free_at_end"]
    assert "a1" not in got["tokens"] or len(got["tokens"]["a1"]) < 20
    for i in (0, 2):
        assert got["tokens"][f"a{i}"] == hf_greedy(prompts[i], 20)
    assert got["tokens"]["moved"] == got["whole"][5:] == hf_greedy(prompts[2], 12)[5:]
    one = LLMEngine(
        replace(config, pipeline_parallel_size=1), model=tiny_model, tokenizer=tokenizer
    )
    seeded = SamplingParams(temperature=1.0, top_k=40, seed=7, max_tokens=10, ignore_eos=True)
    assert got["sampled"] == one.generate([prompts[3]], seeded)[0]
