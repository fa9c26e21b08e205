"""Top-k logprobs and prompt logprobs (echo) over the real cluster's disaggregated path: the
first token's alternatives and the prompt's logprobs come from a prefill worker, the rest from
the decode worker's token channel; gRPC and the `openai` SDK over HTTP, streamed and not,
against transformers' float32 log-softmax of the same checkpoint."""

from __future__ import annotations

import uuid
from typing import Any

import grpc
import openai
import pytest
import torch
from references import LogprobsReference
from router_client import generate, greedy_request, rpc_error
from router_harness import RouterCluster

from vocabulary.tokenizer import Tokenizer

TOL = 1e-4


def _salt() -> str:
    return uuid.uuid4().hex


def test_grpc_top_and_prompt_logprobs_come_through_the_handoff(
    router_cluster: RouterCluster, corpus_ids: list[int], hf_logprobs: LogprobsReference
) -> None:
    prompt = corpus_ids[300:340]
    request = greedy_request(prompt, 6, top_logprobs=4, prompt_logprobs=2, cache_salt=_salt())
    out = generate(router_cluster.generation(0), **request)
    timings = out.final.timings
    assert timings.prefill_worker and not timings.local_prefill  # prefill worker -> decode
    tokens = out.token_ids
    tops = [t for m in out.messages for t in m.top_logprobs]
    chosen = [lp for m in out.messages for lp in m.logprobs]  # implied by top_logprobs
    assert len(tops) == len(chosen) == len(tokens) == 6
    ref = hf_logprobs(prompt + tokens)
    for pos, (token, top, lp) in enumerate(zip(tokens, tops, chosen, strict=True)):
        want = ref[len(prompt) - 1 + pos].topk(4)
        assert list(top.token_ids) == want.indices.tolist()
        assert list(top.logprobs) == pytest.approx(want.values.tolist(), abs=TOL)
        if token in top.token_ids:  # greedy: always, as the first
            assert top.logprobs[list(top.token_ids).index(token)] == pytest.approx(lp, abs=1e-6)
    # the prompt's, on the first message only (entry i: prompt token i + 1)
    first, *rest = out.messages
    assert not any(m.HasField("prompt_logprobs") for m in rest)
    got = first.prompt_logprobs
    target = torch.tensor(prompt[1:])
    want_lp = ref[: len(prompt) - 1].gather(1, target[:, None]).squeeze(1)
    assert list(got.logprobs) == pytest.approx(want_lp.tolist(), abs=TOL)
    want_top = ref[: len(prompt) - 1].topk(2).indices.tolist()
    assert [list(t.token_ids) for t in got.top_logprobs] == want_top
    # more than 20 alternatives: refused naming the field
    err = rpc_error(generate, router_cluster.generation(0), **greedy_request(prompt, 2,
                    top_logprobs=21))  # fmt: skip
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in str(err.details())
    router_cluster.wait_idle()


def test_openai_sdk_reads_top_logprobs_streamed_and_not(
    router_cluster: RouterCluster, client: openai.OpenAI, corpus_ids: list[int]
) -> None:
    prompt = corpus_ids[700:740]
    args: dict[str, Any] = dict(model=router_cluster.model_id, prompt=prompt, max_tokens=5,
                                temperature=0, logprobs=5,
                                extra_body={"ignore_eos": True, "cache_salt": _salt()})  # fmt: skip
    whole = client.completions.create(**args)
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert lp.token_logprobs is not None and len(lp.top_logprobs) == len(lp.tokens) == 5
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 5 <= len(top) <= 6 and top[token] == pytest.approx(value, abs=1e-6)
        assert max(top.values()) == pytest.approx(value, abs=1e-6)  # greedy: the top one
    streamed = list(client.completions.create(**args, stream=True))
    tops = [d for c in streamed if c.choices and c.choices[0].logprobs
            for d in c.choices[0].logprobs.top_logprobs or ()]  # fmt: skip
    assert [list(d) for d in tops] == [list(d) for d in lp.top_logprobs]  # another worker's
    for got, want in zip(tops, lp.top_logprobs, strict=True):  # floats: equal to rounding
        assert list(got.values()) == pytest.approx(list(want.values()), abs=TOL)

    messages = [{"role": "user", "content": "The river runs"}]
    chat_args: dict[str, Any] = dict(model=router_cluster.model_id, messages=messages,
                                     max_completion_tokens=4, temperature=0, logprobs=True,
                                     top_logprobs=3)  # fmt: skip
    chat = client.chat.completions.create(**chat_args)
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
    chunks = list(client.chat.completions.create(**chat_args, stream=True))
    streamed_content = [e for c in chunks if c.choices and c.choices[0].logprobs
                        for e in c.choices[0].logprobs.content or ()]  # fmt: skip
    assert [[t.token for t in e.top_logprobs] for e in streamed_content] == [
        [t.token for t in e.top_logprobs] for e in content
    ]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{**chat_args, "top_logprobs": 21})
    assert "top_logprobs" in str(err.value)
    router_cluster.wait_idle()


def test_echo_returns_the_prompt_and_its_logprobs_as_lm_eval_asks(
    router_cluster: RouterCluster,
    client: openai.OpenAI,
    tokenizer: Tokenizer,
    hf_logprobs: LogprobsReference,
) -> None:
    text = "The river runs past the old mill and under the stone bridge."
    ids = tokenizer.encode(text)
    args: dict[str, Any] = dict(
        model=router_cluster.model_id,
        prompt=text,
        echo=True,
        logprobs=1,
        temperature=0,
        extra_body={"cache_salt": _salt()},
    )
    zero = client.completions.create(**args, max_tokens=0)  # lm-eval's loglikelihood request
    choice = zero.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    assert zero.usage is not None and zero.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    ref = hf_logprobs(ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(ref.tolist(), abs=TOL)
    assert lp.top_logprobs is not None and lp.top_logprobs[0] is None
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    # one token generated, streamed: the first event echoes the prompt, the same values
    one = list(client.completions.create(**args, max_tokens=1, stream=True))
    streamed = [c.choices[0] for c in one if c.choices]
    assert "".join(c.text for c in streamed).startswith(text)
    values = [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs or ()]
    assert values[0] is None and len(values) == len(ids) + 1
    assert values[1 : len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=TOL)
    router_cluster.wait_idle()
