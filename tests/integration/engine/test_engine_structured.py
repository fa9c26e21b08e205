"""Structured output in the engine (engine/structured): every constrained output of the tiny
model, sampled at temperature 1 over many seeds, is in its constraint's language; the
constraint ends the request with finish reason stop; a prefill-only → decode-only hand-off
and a migration resume the matcher from the tokens so far; the free requests of a mixed
batch get the tokens they get alone; a constraint that does not compile is refused naming
the field, and nothing is held after it."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
from engine_factories import make_engine, run_to_completion, text_of, tokens_of

from engine.config import EngineMode
from engine.core.engine import LLMEngine
from engine.modeling.llama import LlamaModel
from vocabulary.engine_io import FinishReason, PriorOutput
from vocabulary.sampling import SamplingParams, SamplingParamsError, StructuredOutput
from vocabulary.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
JSON_SCHEMA = StructuredOutput("json_schema", json.dumps(SCHEMA))
SAMPLED = SamplingParams(temperature=1.0, max_tokens=120)


@pytest.fixture()
def engine(tiny_model_dir: Path, tiny_model: LlamaModel, tokenizer: Tokenizer) -> LLMEngine:
    return make_engine(tiny_model_dir, tiny_model, tokenizer, num_kv_blocks=256)


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams, rid: str = "r") -> tuple:  # type: ignore[type-arg]
    engine.add_request(rid, prompt, params)
    outs = run_to_completion(engine)[rid]
    return text_of(outs), outs[-1].finish_reason, tokens_of(outs)


def test_json_schema_outputs_validate_over_many_seeds(
    engine: LLMEngine, prompts: list[list[int]]
) -> None:
    stopped = 0
    for seed in range(24):
        params = replace(SAMPLED, seed=seed, structured=JSON_SCHEMA)
        text, reason, _ = run(engine, prompts[seed % len(prompts)], params, f"s{seed}")
        if reason is FinishReason.LENGTH:
            continue  # max_tokens cut it (the text is then a prefix of a valid one)
        assert reason is FinishReason.STOP, (seed, text)
        jsonschema.validate(json.loads(text), SCHEMA)
        stopped += 1
    assert stopped >= 20
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        pytest.param(  # (an open object: the tiny model often runs to max_tokens in it)
            StructuredOutput("json_object"),
            lambda text: isinstance(json.loads(text), dict),
            id="json_object",
        ),
        pytest.param(
            StructuredOutput("regex", r"(yes|no), [0-9]{2,4}"),
            lambda text: re.fullmatch(r"(yes|no), [0-9]{2,4}", text) is not None,
            id="regex",
        ),
        pytest.param(
            StructuredOutput("choice", choices=("red", "green", 'blue "sky"')),
            lambda text: text in ("red", "green", 'blue "sky"'),
            id="choice",
        ),
        pytest.param(
            StructuredOutput(
                "grammar", 'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= [a-c] [a-c]?'
            ),
            lambda text: re.fullmatch(r"\([a-c]{1,2}(,[a-c]{1,2}){0,2}\)", text) is not None,
            id="grammar",
        ),
    ],
)
def test_each_kind_stays_in_its_language(
    engine: LLMEngine, prompts: list[list[int]], constraint: StructuredOutput, check
) -> None:  # type: ignore[no-untyped-def]
    stopped = 0
    for seed in range(10):
        params = replace(SAMPLED, seed=seed, structured=constraint, max_tokens=100)
        text, reason, _ = run(engine, prompts[seed % len(prompts)], params, f"s{seed}")
        if reason is FinishReason.STOP:
            assert check(text), (seed, text)
            stopped += 1
    assert stopped >= (1 if constraint.kind == "json_object" else 6)


def test_greedy_and_ignore_eos_still_end_when_the_constraint_is_complete(
    engine: LLMEngine, prompts: list[list[int]]
) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=50, ignore_eos=True,
        structured=StructuredOutput("choice", choices=("alpha", "beta")),
    )  # fmt: skip
    text, reason, _ = run(engine, prompts[0], params)
    assert text in ("alpha", "beta") and reason is FinishReason.STOP


def test_free_requests_beside_constrained_ones_get_their_own_tokens(
    tiny_model_dir: Path, tiny_model: LlamaModel, tokenizer: Tokenizer, prompts: list[list[int]]
) -> None:
    args = (tiny_model_dir, tiny_model, tokenizer)
    free = [replace(SAMPLED, seed=100 + i, max_tokens=30) for i in range(3)]
    alone = make_engine(*args)
    for i, params in enumerate(free):
        alone.add_request(f"f{i}", prompts[i], params)
    want = {rid: tokens_of(outs) for rid, outs in run_to_completion(alone).items()}
    mixed = make_engine(*args)
    for i, params in enumerate(free):
        mixed.add_request(f"f{i}", prompts[i], params)
        mixed.add_request(f"c{i}", prompts[i + 3], replace(SAMPLED, structured=JSON_SCHEMA))
    got = run_to_completion(mixed)
    assert {rid: tokens_of(got[rid]) for rid in want} == want
    for i in range(3):
        text = text_of(got[f"c{i}"])
        if got[f"c{i}"][-1].finish_reason is FinishReason.STOP:
            jsonschema.validate(json.loads(text), SCHEMA)


def test_overlap_on_and_off_give_the_same_constrained_tokens(
    tiny_model_dir: Path, tiny_model: LlamaModel, tokenizer: Tokenizer, prompts: list[list[int]]
) -> None:
    args = (tiny_model_dir, tiny_model, tokenizer)
    results = []
    for overlap in (True, False):
        engine = make_engine(*args, overlap_scheduling=overlap)
        for i in range(4):
            params = replace(SAMPLED, seed=i, structured=JSON_SCHEMA)
            engine.add_request(f"r{i}", prompts[i], params)
        results.append({rid: tokens_of(o) for rid, o in run_to_completion(engine).items()})
    assert results[0] == results[1]


def test_a_hand_off_resumes_the_matcher_from_the_first_token(
    tiny_model_dir: Path, tiny_model: LlamaModel, tokenizer: Tokenizer, prompts: list[list[int]]
) -> None:
    """The decode engine rebuilds the matcher from the tokens so far: its output is the
    colocated run's, token for token (seeded), and valid."""
    args = (tiny_model_dir, tiny_model, tokenizer)
    for seed in range(4):
        params = replace(SAMPLED, seed=seed, structured=JSON_SCHEMA)
        colocated = make_engine(*args)
        want = run(colocated, prompts[seed], params)[2]
        p = make_engine(*args, mode=EngineMode.PREFILL_ONLY)
        d = make_engine(*args, mode=EngineMode.DECODE_ONLY)
        p.add_request("r", prompts[seed], params)
        [out] = run_to_completion(p)["r"]
        handoff = out.kv_handoff
        assert handoff is not None and out.finish_reason is FinishReason.HANDOFF
        alloc = d.allocate_for_transfer("r", prompts[seed], handoff.block_hashes)
        d.kv_cache.copy_blocks_from(p.kv_cache, list(handoff.block_ids), list(alloc.block_ids))
        assert p.release_request_blocks("r")
        d.add_transferred_request("r", handoff.first_token_id, params)
        decoded = run_to_completion(d)["r"]
        assert [handoff.first_token_id, *tokens_of(decoded)] == want
        if decoded[-1].finish_reason is FinishReason.STOP:
            text = tokenizer.decode(want)
            jsonschema.validate(json.loads(text), SCHEMA)
        assert d.block_pool.num_free == d.block_pool.num_blocks


def test_a_migrated_request_resumes_from_its_prior_tokens(
    engine: LLMEngine, tokenizer: Tokenizer, prompts: list[list[int]]
) -> None:
    params = replace(SAMPLED, seed=7, structured=JSON_SCHEMA)
    whole = run(engine, prompts[1], params, "whole")[2]
    prior = tuple(whole[:5])
    text = tokenizer.decode(prior)
    engine.add_request("moved", prompts[1], params, prior=PriorOutput(prior, len(text)))
    rest = tokens_of(run_to_completion(engine)["moved"])
    assert [*prior, *rest] == whole


def test_tokens_that_break_the_constraint_are_refused(
    engine: LLMEngine, tokenizer: Tokenizer, prompts: list[list[int]]
) -> None:
    params = replace(SAMPLED, structured=StructuredOutput("regex", "[0-9]+"))
    prior = tuple(tokenizer.encode("abc", add_special_tokens=False))
    with pytest.raises(SamplingParamsError, match="structured_output"):
        engine.add_request("r", prompts[0], params, prior=PriorOutput(prior, 3))
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        (StructuredOutput("json_schema", "{not json"), "not JSON"),
        (StructuredOutput("json_schema", '{"type": "nonsense"}'), "does not compile"),
        (StructuredOutput("regex", "[a-"), "does not compile"),
        (StructuredOutput("grammar", "root ::= "), "does not compile"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_naming_the_field(
    engine: LLMEngine, prompts: list[list[int]], constraint: StructuredOutput, words: str
) -> None:
    with pytest.raises(SamplingParamsError, match=f"structured_output: .*{words}"):
        engine.add_request("bad", prompts[0], replace(SAMPLED, structured=constraint))
    assert not engine.has_unfinished()
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    # the engine goes on serving, the same constraint fixed included
    reason = run(engine, prompts[0], replace(SAMPLED, seed=1, structured=JSON_SCHEMA))[1]
    assert reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_compiled_constraints_are_cached_and_bounded(
    tiny_model_dir: Path, tiny_model: LlamaModel, tokenizer: Tokenizer
) -> None:
    engine = make_engine(tiny_model_dir, tiny_model, tokenizer, grammar_cache_size=2)
    grammars = engine.constrained.grammars
    regexes = [StructuredOutput("regex", f"[a-c]{{{n}}}") for n in (1, 2, 3)]
    first = grammars.compile(regexes[0])
    assert grammars.compile(regexes[0]) is first  # cached
    grammars.compile(regexes[1])
    grammars.compile(regexes[2])  # evicts the least recently used: regexes[0]
    assert grammars.compile(regexes[0]) is not first


def test_compiled_says_whether_a_constraint_waits_on_nothing(
    engine: LLMEngine, prompts: list[list[int]]
) -> None:
    constrained = engine.constrained
    regex = StructuredOutput("regex", "[a-c]{4}")
    assert not constrained.compiled(regex)  # before the grammars exist (nothing built by asking)
    constrained.compile(regex)
    assert constrained.compiled(regex)
    bad = StructuredOutput("grammar", "root ::= ")
    with pytest.raises(SamplingParamsError):
        constrained.compile(bad)
    assert not constrained.compiled(bad)  # a failure is not a hit: the next request retries it
    assert not constrained.compiled(StructuredOutput("regex", "[a-c]{5}"))
