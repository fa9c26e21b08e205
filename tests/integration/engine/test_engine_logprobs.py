"""Logprobs through the whole engine on the tiny model: the top-k alternatives of generated
tokens and the prompt's logprobs (chunked or not, with the prefix cache, prefill-only),
against transformers' float32 log-softmax of the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_factories import greedy, make_engine, run_to_completion, tokens_of
from references import LogprobsReference

from engine.config import EngineMode
from engine.core.engine import LLMEngine
from engine.modeling.llama import LlamaModel
from vocabulary.engine_io import FinishReason, RequestOutput
from vocabulary.logprobs import NO_TOP
from vocabulary.tokenizer import Tokenizer

TOL = 1e-4


@pytest.fixture()
def engine(tiny_model_dir: Path, tiny_model: LlamaModel, tokenizer: Tokenizer) -> LLMEngine:
    return make_engine(tiny_model_dir, tiny_model, tokenizer)


def _prompt_reference(
    hf_logprobs: LogprobsReference, prompt: list[int], k: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Per prompt token 1.., its logprob, and the top-k ids and logprobs at its position."""
    lp = hf_logprobs(prompt)[:-1]
    target = torch.tensor(prompt[1:])
    chosen = lp.gather(1, target[:, None]).squeeze(1).tolist()
    top = lp.topk(k, dim=-1) if k else None
    ids = top.indices.tolist() if top is not None else [[] for _ in chosen]
    values = top.values.tolist() if top is not None else [[] for _ in chosen]
    return chosen, ids, values


def _check_prompt(out: RequestOutput, prompt: list[int], k: int, hf: LogprobsReference) -> None:
    got = out.prompt_logprobs
    assert got is not None
    assert len(got.logprobs) == len(got.top) == len(prompt)
    assert got.logprobs[0] is None and got.top[0] == NO_TOP
    chosen, ids, values = _prompt_reference(hf, prompt, k)
    assert got.logprobs[1:] == pytest.approx(chosen, abs=TOL)
    assert [list(t.token_ids) for t in got.top[1:]] == ids
    for t, want in zip(got.top[1:], values, strict=True):
        assert list(t.logprobs) == pytest.approx(want, abs=TOL)


def test_generated_tokens_report_the_transformers_top_k(
    engine: LLMEngine, prompts: list[list[int]], hf_logprobs: LogprobsReference
) -> None:
    # r0 asks for 5 alternatives, r1 for none (in the same batch), r2 for 20
    for rid, k in (("r0", 5), ("r1", 0), ("r2", 20)):
        engine.add_request(rid, prompts[int(rid[1])], greedy(6, top_logprobs=k))
    outs = run_to_completion(engine)
    assert all(o.top_logprobs is None and o.logprobs is None for o in outs["r1"])
    for rid, k in (("r0", 5), ("r2", 20)):
        prompt = prompts[int(rid[1])]
        tokens = tokens_of(outs[rid])
        tops = [t for o in outs[rid] for t in (o.top_logprobs or ())]
        lps = [lp for o in outs[rid] for lp in (o.logprobs or ())]  # implied by top_logprobs
        assert len(tops) == len(lps) == len(tokens) == 6
        ref = hf_logprobs(prompt + tokens)[len(prompt) - 1 : -1]
        for pos, (token, top, lp) in enumerate(zip(tokens, tops, lps, strict=True)):
            want = ref[pos].topk(k)
            assert list(top.token_ids) == want.indices.tolist()
            assert list(top.logprobs) == pytest.approx(want.values.tolist(), abs=TOL)
            assert top.token_ids[0] == token and top.logprobs[0] == pytest.approx(lp, abs=1e-6)


def test_prompt_logprobs_equal_the_transformers_ones(
    engine: LLMEngine, prompts: list[list[int]], hf_logprobs: LogprobsReference
) -> None:
    engine.add_request("k3", prompts[2], greedy(3, prompt_logprobs=3))
    engine.add_request("k0", prompts[7], greedy(3, prompt_logprobs=0))
    engine.add_request("none", prompts[0], greedy(3))
    outs = run_to_completion(engine)
    _check_prompt(outs["k3"][0], prompts[2], 3, hf_logprobs)
    _check_prompt(outs["k0"][0], prompts[7], 0, hf_logprobs)
    assert all(o.prompt_logprobs is None for o in outs["k3"][1:] + outs["none"])


def test_chunked_prefill_accumulates_the_prompt_logprobs_of_every_chunk(
    tiny_model_dir: Path,
    tiny_model: LlamaModel,
    tokenizer: Tokenizer,
    corpus_ids: list[int],
    hf_logprobs: LogprobsReference,
) -> None:
    prompt = corpus_ids[:150]
    params = greedy(2, prompt_logprobs=4)
    whole = make_engine(tiny_model_dir, tiny_model, tokenizer)
    chunked = make_engine(tiny_model_dir, tiny_model, tokenizer, max_num_batched_tokens=32)
    results = []
    for engine in (whole, chunked):
        engine.add_request("r", prompt, params)
        results.append(run_to_completion(engine)["r"])
    a, b = results[0][0].prompt_logprobs, results[1][0].prompt_logprobs
    assert a is not None and b is not None
    assert b.logprobs[1:] == pytest.approx(a.logprobs[1:], abs=TOL)
    assert [t.token_ids for t in b.top] == [t.token_ids for t in a.top]
    assert tokens_of(results[0]) == tokens_of(results[1])
    _check_prompt(results[1][0], prompt, 4, hf_logprobs)


def test_prompt_logprobs_recompute_a_cached_prefix_and_free_their_blocks(
    engine: LLMEngine, prompts: list[list[int]], hf_logprobs: LogprobsReference
) -> None:
    engine.add_request("warm", prompts[2], greedy(2))
    run_to_completion(engine)
    engine.add_request("cached", prompts[2], greedy(2))
    assert run_to_completion(engine)["cached"][-1].num_cached_prompt_tokens > 0
    engine.add_request("asks", prompts[2], greedy(2, prompt_logprobs=2))
    out = run_to_completion(engine)["asks"]
    assert out[-1].num_cached_prompt_tokens == 0
    _check_prompt(out[0], prompts[2], 2, hf_logprobs)
    engine.add_request("aborted", prompts[2], greedy(5, prompt_logprobs=2))
    engine.step()
    assert engine.abort_request("aborted")
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_prefill_only_hands_off_the_prompt_logprobs_and_first_alternatives(
    tiny_model_dir: Path,
    tiny_model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    hf_logprobs: LogprobsReference,
) -> None:
    p = make_engine(tiny_model_dir, tiny_model, tokenizer, mode=EngineMode.PREFILL_ONLY)
    p.add_request("r", prompts[4], greedy(5, prompt_logprobs=1, top_logprobs=2))
    (out,) = run_to_completion(p)["r"]
    assert out.finish_reason is FinishReason.HANDOFF
    _check_prompt(out, prompts[4], 1, hf_logprobs)
    assert out.top_logprobs is not None and len(out.top_logprobs) == 1
    want = hf_logprobs(prompts[4])[-1].topk(2)
    assert list(out.top_logprobs[0].token_ids) == want.indices.tolist()
    assert p.release_request_blocks("r")
    assert p.block_pool.num_free == p.block_pool.num_blocks
