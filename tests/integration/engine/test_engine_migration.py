"""A migrated request (vocabulary.engine_io.PriorOutput): output another engine produced is
prefilled after the prompt and counted as output, so the rest of the stream is the one an
undisturbed run gives: greedy, seeded sampling with penalties, a stop string that spans the
point of migration, and through a prefill-only → decode-only hand-off."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_factories import greedy, make_engine, run_to_completion, text_of, tokens_of
from references import Reference

from engine.config import EngineMode
from engine.core.engine import LLMEngine
from engine.modeling.llama import LlamaModel
from vocabulary.engine_io import FinishReason, PriorOutput, RequestOutput
from vocabulary.sampling import SamplingParams
from vocabulary.tokenizer import Tokenizer

SEEDED = SamplingParams(
    temperature=1.0, top_k=40, seed=7, max_tokens=24, ignore_eos=True,
    repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
)  # fmt: skip


@pytest.fixture()
def engine(tiny_model_dir: Path, tiny_model: LlamaModel, tokenizer: Tokenizer) -> LLMEngine:
    return make_engine(tiny_model_dir, tiny_model, tokenizer)


def undisturbed(
    engine: LLMEngine, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    engine.add_request("whole", prompt, params)
    return run_to_completion(engine)["whole"]


def released(outputs: list[RequestOutput], k: int) -> PriorOutput:
    """What a client had after the first k tokens of `outputs` (one token per output)."""
    assert all(len(o.new_token_ids) == 1 for o in outputs)
    return PriorOutput(tuple(tokens_of(outputs[:k])), len(text_of(outputs[:k])))


@pytest.mark.parametrize("k", [1, 5, 17])
def test_greedy_continues_as_one_undisturbed_run(
    engine: LLMEngine, prompts: list[list[int]], hf_greedy: Reference, k: int
) -> None:
    params = greedy(24)
    whole = undisturbed(engine, prompts[2], params)
    assert tokens_of(whole) == hf_greedy(prompts[2], 24)
    engine.add_request("moved", prompts[2], params, prior=released(whole, k))
    rest = run_to_completion(engine)["moved"]
    assert tokens_of(rest) == tokens_of(whole)[k:]
    assert text_of(rest) == text_of(whole[k:])
    assert rest[-1].num_output_tokens == 24 and rest[-1].finish_reason is FinishReason.LENGTH
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


@pytest.mark.parametrize("k", [1, 9])
def test_seeded_sampling_with_penalties_continues_its_random_stream(
    engine: LLMEngine, prompts: list[list[int]], k: int
) -> None:
    whole = undisturbed(engine, prompts[4], SEEDED)
    engine.add_request("moved", prompts[4], SEEDED, prior=released(whole, k))
    assert tokens_of(run_to_completion(engine)["moved"]) == tokens_of(whole)[k:]


def test_a_stop_string_across_the_point_of_migration_still_stops_it(
    engine: LLMEngine, prompts: list[list[int]]
) -> None:
    free = undisturbed(engine, prompts[0], greedy(24))
    text = text_of(free)
    # a stop string that starts in the text of token 5 and ends in a later token's text
    start = len(text_of(free[:5])) - 1
    stop = text[start : start + 6]
    assert len(stop) == 6 and text.find(stop) == start, (text, stop)
    params = greedy(24, stop=(stop,))
    whole = undisturbed(engine, prompts[0], params)
    assert whole[-1].finish_reason is FinishReason.STOP and text_of(whole) == text[:start]
    # migrated after token 5: the client had its text but the held-back tail
    prior = released(whole, 5)
    assert prior.text_chars < len(text_of(free[:5]))
    engine.add_request("moved", prompts[0], params, prior=prior)
    rest = run_to_completion(engine)["moved"]
    assert tokens_of(rest) == tokens_of(whole)[5:]
    assert text_of(whole[:5]) + text_of(rest) == text[:start]
    assert rest[-1].finish_reason is FinishReason.STOP and rest[-1].stop_reason == stop


def test_a_hand_off_continues_after_the_clients_tokens(
    tiny_model_dir: Path,
    tiny_model: LlamaModel,
    tokenizer: Tokenizer,
    engine: LLMEngine,
    prompts: list[list[int]],
) -> None:
    """The router's re-prefill: prompt + the tokens sent but the last on a prefill-only
    engine (its own sampled token dropped), pulled by a decode-only engine that goes on
    after the client's last token with the others as its prior."""
    args = (tiny_model_dir, tiny_model, tokenizer)
    p = make_engine(*args, mode=EngineMode.PREFILL_ONLY, num_kv_blocks=64)
    d = make_engine(*args, mode=EngineMode.DECODE_ONLY, num_kv_blocks=48)
    whole = undisturbed(engine, prompts[3], SEEDED)
    sent = tokens_of(whole[:11])
    kv_tokens = [*prompts[3], *sent[:-1]]
    p.add_request("moved", kv_tokens, greedy(2))
    [out] = run_to_completion(p)["moved"]
    handoff = out.kv_handoff
    assert handoff is not None and handoff.num_tokens == len(kv_tokens)
    alloc = d.allocate_for_transfer("moved", kv_tokens, handoff.block_hashes)
    d.kv_cache.copy_blocks_from(p.kv_cache, list(handoff.block_ids), list(alloc.block_ids))
    assert p.release_request_blocks("moved")
    prior = PriorOutput(tuple(sent[:-1]), len(text_of(whole[:11])))
    d.add_transferred_request("moved", sent[-1], SEEDED, prior=prior)
    rest = run_to_completion(d)["moved"]
    assert tokens_of(rest) == tokens_of(whole)[11:]
    assert text_of(rest) == text_of(whole[11:])
    assert rest[-1].num_output_tokens == SEEDED.max_tokens
    for e in (p, d):
        assert e.block_pool.num_free == e.block_pool.num_blocks


def test_a_prior_that_could_not_have_come_from_a_running_request_is_refused(
    engine: LLMEngine, prompts: list[list[int]]
) -> None:
    with pytest.raises(ValueError, match="prior: token id 999999 is outside"):
        engine.add_request("a", prompts[0], greedy(8), prior=PriorOutput((5, 999999)))
    with pytest.raises(ValueError, match="prior: 8 tokens leave none of max_tokens=8"):
        engine.add_request("b", prompts[0], greedy(8), prior=PriorOutput(tuple(range(8))))
    with pytest.raises(ValueError, match="text_chars: -1 is negative"):
        PriorOutput((5,), -1)
    assert not engine.has_unfinished()
