"""Small factories for end-to-end engine tests."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.batch import ScheduledBatch
from engine.config import EngineConfig, EngineMode
from engine.core.engine import LLMEngine
from engine.modeling.llama import LlamaModel
from vocabulary.engine_io import RequestOutput
from vocabulary.sampling import SamplingParams
from vocabulary.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def make_engine(
    model_dir: Path,
    model: LlamaModel,
    tokenizer: Tokenizer,
    mode: EngineMode = EngineMode.COLOCATED,
    **overrides: Any,
) -> LLMEngine:
    config = EngineConfig(
        model_dir=str(model_dir),
        mode=mode,
        device="cpu",
        dtype="float32",
        block_size=16,
        num_kv_blocks=128,
        cuda_graphs=False,
        attention_backend="torch",
    )
    return LLMEngine(replace(config, **overrides), model=model, tokenizer=tokenizer)


def greedy(max_tokens: int = 10, **overrides: Any) -> SamplingParams:
    return replace(GREEDY, max_tokens=max_tokens, **overrides)


def run_to_completion(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step until nothing is unfinished; every output, grouped by request id."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish within 10000 steps")


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def text_of(outputs: list[RequestOutput]) -> str:
    return "".join(out.text_delta for out in outputs)


def record_batches(engine: LLMEngine) -> list[ScheduledBatch]:
    """A list that receives every batch the engine's scheduler decides from now on."""
    batches: list[ScheduledBatch] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        decision = schedule()
        batches.append(decision.batch)
        return decision

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    return batches
