"""Step statistics: every engine step that ran a batch is timed and its batch shape counted
(the router exports them per worker: router/worker_metrics.py)."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from vocabulary.sampling import SamplingParams
from vocabulary.step_stats import BATCH_REQUESTS_BUCKETS, STEP_SECONDS_BUCKETS, StepMeter, StepStats


def test_meter_puts_each_step_in_the_bucket_of_its_upper_bound() -> None:
    meter = StepMeter()
    assert meter.snapshot() == StepStats()
    meter.record(1, 12, 0, 0.001)  # exactly on a bound: that bucket (Prometheus `le`)
    meter.record(3, 0, 3, 0.0011)
    meter.record(2000, 0, 2000, 60.0)  # past the last bound: the overflow bucket
    stats = meter.snapshot()
    assert stats.num_steps == 3
    assert stats.step_seconds == 0.001 + 0.0011 + 60.0
    assert len(stats.step_seconds_buckets) == len(STEP_SECONDS_BUCKETS) + 1
    one_ms = STEP_SECONDS_BUCKETS.index(0.001)
    assert stats.step_seconds_buckets[one_ms] == 1
    assert stats.step_seconds_buckets[one_ms + 1] == 1
    assert stats.step_seconds_buckets[-1] == 1
    assert sum(stats.step_seconds_buckets) == 3
    assert stats.batch_requests == 2004
    assert stats.batch_requests_buckets[BATCH_REQUESTS_BUCKETS.index(1)] == 1
    assert stats.batch_requests_buckets[BATCH_REQUESTS_BUCKETS.index(4)] == 1
    assert stats.batch_requests_buckets[-1] == 1
    assert (stats.prefill_tokens, stats.decode_tokens) == (12, 2003)
    assert meter.snapshot() is stats  # unchanged until the next step


def test_engine_counts_prompt_and_generated_tokens_of_its_steps(tiny_model_dir: Path) -> None:
    engine = LLMEngine(
        EngineConfig(
            model_dir=str(tiny_model_dir),
            num_kv_blocks=64,
            cuda_graphs=False,
            overlap_scheduling=False,  # no step launched past the last token
        )
    )
    prompt = engine.tokenizer.encode("The river runs past the old mill")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.generate([prompt], params)
    steps = engine.load().steps
    # one prefill step (the prompt, sampling token 1), then one step per further token
    assert steps.num_steps == 4
    assert steps.prefill_tokens == len(prompt)
    assert steps.decode_tokens == 3
    assert steps.batch_requests == 4
    assert sum(steps.step_seconds_buckets) == 4
    assert steps.step_seconds > 0

    engine.generate([prompt, prompt[:-1]], params)  # two requests in each step
    after = engine.load().steps
    assert after.num_steps == 8
    assert after.batch_requests == 4 + 2 * 4
    assert after.decode_tokens == 3 + 2 * 3
