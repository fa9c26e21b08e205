"""Stopping (eos, stop tokens, stop strings) and sampling (seeds, penalties) through the
whole engine on the tiny model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_factories import greedy, make_engine, run_to_completion, text_of, tokens_of
from references import LogitsReference, Reference
from sampling_ties import assert_same_or_near_tie, draw_keys

from engine.config import EngineMode
from engine.core.engine import LLMEngine
from engine.modeling.llama import LlamaModel
from vocabulary.engine_io import FinishReason
from vocabulary.sampling import SamplingParams
from vocabulary.tokenizer import Tokenizer

EOS = 1


@pytest.fixture()
def engine(tiny_model_dir: Path, tiny_model: LlamaModel, tokenizer: Tokenizer) -> LLMEngine:
    return make_engine(tiny_model_dir, tiny_model, tokenizer)


def test_eos_stops_generation_unless_ignored(
    engine: LLMEngine, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    ref = hf_greedy(prompts[5], 10)
    assert EOS in ref
    end = ref.index(EOS) + 1
    engine.add_request("stop", prompts[5], greedy(10, ignore_eos=False))
    engine.add_request("ignore", prompts[5], greedy(10, ignore_eos=True))
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["stop"]) == ref[:end]
    assert outputs["stop"][-1].finish_reason is FinishReason.STOP
    assert outputs["stop"][-1].stop_reason is None
    assert tokens_of(outputs["ignore"]) == ref


def test_stop_token_is_included_in_tokens_but_not_in_text(
    engine: LLMEngine, prompts: list[list[int]], hf_greedy: Reference, tokenizer: Tokenizer
) -> None:
    ref = hf_greedy(prompts[0], 10)
    stop_token = ref[3]
    end = ref.index(stop_token) + 1
    engine.add_request("r", prompts[0], greedy(10, stop_token_ids=(stop_token,)))
    outputs = run_to_completion(engine)["r"]
    assert tokens_of(outputs) == ref[:end]
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert outputs[-1].stop_reason == stop_token
    assert text_of(outputs) == tokenizer.decode(ref[: end - 1])


def test_stop_string_ends_generation_and_is_cut_from_the_text(
    engine: LLMEngine, prompts: list[list[int]], hf_greedy: Reference, tokenizer: Tokenizer
) -> None:
    ref = hf_greedy(prompts[1], 16)
    text = tokenizer.decode(ref)
    stop = text[10:14]
    cut = text.index(stop)
    # The request ends on the first token whose text completes the stop string.
    end = next(k for k in range(1, 17) if stop in tokenizer.decode(ref[:k]))
    engine.add_request("r", prompts[1], greedy(16, stop=(stop, "never-seen")))
    outputs = run_to_completion(engine)["r"]
    assert tokens_of(outputs) == ref[:end]
    assert text_of(outputs) == text[:cut]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == (FinishReason.STOP, stop)
    # While running, no delta ever carried a prefix of the stop string past the cut.
    released = ""
    for out in outputs:
        released += out.text_delta
        assert text[:cut].startswith(released)


SAMPLED = SamplingParams(temperature=4.0, top_p=0.95, top_k=50, max_tokens=12, ignore_eos=True)


def test_seeded_sampling_is_reproducible_whatever_the_batch(
    tiny_model_dir: Path,
    tiny_model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
) -> None:
    args = (tiny_model_dir, tiny_model, tokenizer)
    alone = make_engine(*args)
    alone.add_request("s", prompts[3], replace(SAMPLED, seed=1234))
    crowd = make_engine(*args, seed=7)
    crowd.add_request("a", prompts[0], SAMPLED)
    crowd.add_request("s", prompts[3], replace(SAMPLED, seed=1234))
    crowd.add_request("b", prompts[1], replace(SAMPLED, seed=99))
    crowd.add_request("other-seed", prompts[3], replace(SAMPLED, seed=4321))
    first, second = run_to_completion(alone), run_to_completion(crowd)
    assert tokens_of(first["s"]) == tokens_of(second["s"])
    assert tokens_of(second["s"]) != tokens_of(second["other-seed"])


def test_seeded_handoff_continues_the_colocated_random_stream(
    tiny_model_dir: Path,
    tiny_model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
) -> None:
    args = (tiny_model_dir, tiny_model, tokenizer)
    params = replace(SAMPLED, seed=42)
    colocated = make_engine(*args)
    colocated.add_request("r", prompts[4], params)
    want = tokens_of(run_to_completion(colocated)["r"])
    p = make_engine(*args, mode=EngineMode.PREFILL_ONLY)
    d = make_engine(*args, mode=EngineMode.DECODE_ONLY)
    p.add_request("r", prompts[4], params)
    [out] = run_to_completion(p)["r"]
    assert out.kv_handoff is not None
    alloc = d.allocate_for_transfer("r", prompts[4], out.kv_handoff.block_hashes)
    d.kv_cache.copy_blocks_from(p.kv_cache, list(out.kv_handoff.block_ids), list(alloc.block_ids))
    d.add_transferred_request("r", out.kv_handoff.first_token_id, params)
    assert [out.kv_handoff.first_token_id, *tokens_of(run_to_completion(d)["r"])] == want


def test_repetition_penalty_matches_a_transformers_reference(
    engine: LLMEngine, prompts: list[list[int]], tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    prompt, penalty = prompts[3], 1.5
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(10):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            seen = torch.tensor(sorted(set(ids)))
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
            ids.append(int(logits.argmax()))
    engine.add_request("r", prompt, greedy(10, repetition_penalty=penalty))
    assert tokens_of(run_to_completion(engine)["r"]) == ids[len(prompt) :]


def test_logit_bias_steers_its_request_and_leaves_its_neighbours_alone(
    engine: LLMEngine, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    ref = hf_greedy(prompts[2], 8)
    banned = ref[0]  # the reference's first token, -100: never chosen
    engine.add_request("forced", prompts[0], greedy(8, ignore_eos=True, logit_bias={42: 100.0}))
    engine.add_request("plain", prompts[2], greedy(8, ignore_eos=True))
    engine.add_request("banned", prompts[2], greedy(8, ignore_eos=True, logit_bias={banned: -100}))
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["forced"]) == [42] * 8  # the first token (prefill) too
    assert tokens_of(outputs["plain"]) == ref  # in the same batches, untouched
    assert banned not in tokens_of(outputs["banned"])
    with pytest.raises(ValueError, match=r"logit_bias: token id \d+ is outside"):
        engine.add_request("x", prompts[0], greedy(2, logit_bias={10**6: 1.0}))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, temperature=0.9, top_k=50, seed=1234,
                       repetition_penalty=1.2, presence_penalty=0.3, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True),
    ],
    ids=["penalties-top-k", "top-p"],
)  # fmt: skip
def test_the_near_tie_rule_keys_give_the_engine_s_seeded_tokens(
    engine: LLMEngine, prompts: list[list[int]], hf_logits: LogitsReference,
    params: SamplingParams,
) -> None:  # fmt: skip
    """tests/sampling_ties.py's keys, from transformers' logits, pick every token a seeded
    request draws (the rule the migration tests part streams by), and the rule refuses a
    stream that parts where the keys are far apart."""
    prompt = prompts[3]
    engine.add_request("seeded", prompt, params)
    got = tokens_of(run_to_completion(engine)["seeded"])
    logits = hf_logits([*prompt, *got])
    for t, token in enumerate(got):
        keys = draw_keys(logits[len(prompt) + t - 1], params, prompt, got[:t])
        assert int(keys.argmax()) == token, t
    other = int(draw_keys(logits[len(prompt) + 9], params, prompt, got[:10]).topk(2).indices[1])
    with pytest.raises(AssertionError, match="token 10"):
        assert_same_or_near_tie([*got[:10], other], got[:11], prompt, params, hf_logits)
