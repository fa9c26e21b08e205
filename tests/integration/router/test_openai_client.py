"""The official `openai` Python client against the real cluster's OpenAI-compatible HTTP API:
completions and chat, streamed and not, greedy tokens equal to the gRPC path's for the same
request, n=2 siblings (reproducible seeds, the prompt's blocks shared), stop strings, seed
reproducibility, logprobs, usage with cached tokens, and the chat template rendered as
transformers renders it."""

from __future__ import annotations

import json
import urllib.request
import uuid
from typing import Any

import openai
import pytest
from router_client import generate, greedy_request, http_url
from router_harness import SERVED_LORA, RouterCluster

from vocabulary.tokenizer import Tokenizer

MAX_TOKENS = 12


def _salt() -> dict[str, Any]:
    """A cache salt of its own: no prefix-cache hit from another test."""
    return {"cache_salt": uuid.uuid4().hex}


def _extra(choice: Any, name: str) -> Any:
    return (choice.model_extra or {})[name]


def test_models_health_and_ready(router_cluster: RouterCluster, client: openai.OpenAI) -> None:
    # the base model, then the adapters the cluster serves (test_router_lora owns the others)
    models = [m.id for m in client.models.list()]
    assert models[0] == router_cluster.model_id and SERVED_LORA in models[1:]
    assert client.models.retrieve(router_cluster.model_id).id == router_cluster.model_id
    base = http_url(router_cluster)
    with urllib.request.urlopen(base + "/health", timeout=10) as r:
        assert json.load(r) == {"status": "ok"}
    with urllib.request.urlopen(base + "/ready", timeout=10) as r:
        assert json.load(r) == {"status": "ready", "decode_workers": 1, "prefill_workers": 2}
    # each replica its own port, and `pdserve status` shows it
    from typer.testing import CliRunner

    from deploy.cli.app import app

    assert http_url(router_cluster, 1) != base
    admin = router_cluster.admin_targets[0]  # status is on the admin plane
    shown = CliRunner().invoke(app, ["status", "--target", admin])
    assert shown.exit_code == 0, shown.output
    # the data plane's gRPC address, not the admin plane's the status came from
    data_plane = router_cluster.targets[0]
    assert data_plane != admin and f"gRPC {data_plane} · OpenAI {base}/v1" in shown.output
    as_json = CliRunner().invoke(app, ["status", "--json", "--target", admin])
    shown_json = json.JSONDecoder().raw_decode(as_json.output)[0]
    assert (shown_json["http_url"], shown_json["grpc_target"]) == (base, data_plane)


def test_greedy_completion_tokens_equal_the_grpc_path_streamed_and_not(
    router_cluster: RouterCluster, client: openai.OpenAI, corpus_ids: list[int]
) -> None:
    prompt = corpus_ids[100:160]
    grpc_out = generate(router_cluster.generation(0), **greedy_request(prompt, MAX_TOKENS))
    body = {"ignore_eos": True, "return_token_ids": True}
    whole = client.completions.create(
        model=router_cluster.model_id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        extra_body=body,
    )  # fmt: skip
    (choice,) = whole.choices
    assert _extra(choice, "token_ids") == grpc_out.token_ids
    assert _extra(choice, "prompt_token_ids") == prompt
    assert choice.text == grpc_out.text
    assert choice.finish_reason == "length"
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt), MAX_TOKENS)
    assert whole.usage.total_tokens == len(prompt) + MAX_TOKENS

    stream = client.completions.create(
        model=router_cluster.model_id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body=body,
    )  # fmt: skip
    chunks = list(stream)
    *content, usage_chunk = chunks
    assert [t for c in content for t in _extra(c.choices[0], "token_ids")] == grpc_out.token_ids
    assert "".join(c.choices[0].text for c in content) == grpc_out.text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == MAX_TOKENS
    router_cluster.wait_idle()


def test_logit_bias_travels_through_the_disaggregated_path_over_http_and_grpc(
    router_cluster: RouterCluster, client: openai.OpenAI, corpus_ids: list[int]
) -> None:
    """The first token is sampled on a prefill worker, the rest on the decode worker: both
    apply the bias (the OpenAI SDK's `logit_bias`, the gRPC map)."""
    prompt = corpus_ids[200:240]
    body = {"ignore_eos": True, "return_token_ids": True, **_salt()}
    out = client.completions.create(
        model=router_cluster.model_id, prompt=prompt, max_tokens=6, temperature=0,
        logit_bias={"42": 100}, extra_body=body,
    )  # fmt: skip
    assert _extra(out.choices[0], "token_ids") == [42] * 6
    request = greedy_request(prompt, 6, logit_bias={42: 100.0}, cache_salt="bias")
    assert list(generate(router_cluster.generation(0), **request).token_ids) == [42] * 6
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model=router_cluster.model_id, prompt=prompt, max_tokens=2, logit_bias={"42": 101}
        )
    assert "logit_bias" in str(err.value)
    router_cluster.wait_idle()


def test_chat_renders_the_checkpoint_template_and_streams_what_it_returns_whole(
    router_cluster: RouterCluster, client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    from transformers import PreTrainedTokenizerFast

    messages: list[Any] = [
        {"role": "system", "content": "You tell short stories."},
        {"role": "user", "content": [{"type": "text", "text": "The baker"}]},
    ]
    hf = PreTrainedTokenizerFast.from_pretrained(str(router_cluster.model_dir))
    rendered = hf.apply_chat_template(
        [messages[0], {"role": "user", "content": "The baker"}], tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    assert rendered.endswith("User: The baker\nAssistant:")
    args: dict[str, Any] = dict(model=router_cluster.model_id, messages=messages, temperature=0,
                                max_completion_tokens=MAX_TOKENS)  # fmt: skip
    body = {"ignore_eos": True, "return_token_ids": True}
    whole = client.chat.completions.create(**args, extra_body=body)
    (choice,) = whole.choices
    expected_prompt = tokenizer.encode(rendered, add_special_tokens=False)
    assert _extra(choice, "prompt_token_ids") == expected_prompt
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")

    chunks = list(client.chat.completions.create(**args, stream=True, extra_body=body))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert [t for c in chunks for t in _extra(c.choices[0], "token_ids")] == _extra(
        choice, "token_ids"
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n2_siblings_are_the_seeds_seed_and_seed_plus_1_and_share_the_prompt_blocks(
    router_cluster: RouterCluster, client: openai.OpenAI, corpus_ids: list[int]
) -> None:
    prompt = corpus_ids[1200:1400]
    salt = _salt()
    args: dict[str, Any] = dict(model=router_cluster.model_id, prompt=prompt, max_tokens=8,
                                temperature=1.0)  # fmt: skip
    hits_before = _prefix_cache_hits(router_cluster)
    both = client.completions.create(**args, n=2, seed=41, extra_body=salt)
    hits = _prefix_cache_hits(router_cluster) - hits_before
    assert [c.index for c in both.choices] == [0, 1]
    assert both.usage is not None
    assert both.usage.prompt_tokens == len(prompt)  # one prompt, counted once
    assert both.usage.completion_tokens == 16
    # The second sibling found the first one's prompt blocks in a prefix cache.
    assert hits >= len(prompt) // 2, hits
    for seed, choice in zip((41, 42), both.choices, strict=True):
        alone = client.completions.create(**args, seed=seed, extra_body=salt)
        assert alone.choices[0].text == choice.text
    # streamed: the two choices' chunks interleave, each ends once, usage counts both
    chunks = list(client.completions.create(**args, n=2, seed=41, extra_body=salt, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    *content, last = chunks
    for choice in both.choices:
        mine = [c.choices[0] for c in content if c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    assert last.usage is not None and last.usage.completion_tokens == 16


def test_same_seed_same_text_and_the_grpc_path_agrees(
    router_cluster: RouterCluster, client: openai.OpenAI, corpus_ids: list[int]
) -> None:
    prompt = corpus_ids[300:340]
    args: dict[str, Any] = dict(
        model=router_cluster.model_id, prompt=prompt, max_tokens=10, temperature=0.9,
        top_p=0.95, seed=1234, extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    first = client.completions.create(**args).choices[0]
    again = client.completions.create(**args).choices[0]
    assert _extra(again, "token_ids") == _extra(first, "token_ids")
    grpc_out = generate(
        router_cluster.generation(1), token_ids=prompt, max_tokens=10, temperature=0.9,
        top_p=0.95, seed=1234, ignore_eos=True,
    )  # fmt: skip
    assert grpc_out.token_ids == _extra(first, "token_ids")


def test_stop_string_ends_the_text_before_it(
    router_cluster: RouterCluster, client: openai.OpenAI
) -> None:
    args: dict[str, Any] = dict(model=router_cluster.model_id, prompt="Once upon a time",
                                max_tokens=24, temperature=0)  # fmt: skip
    full = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[8:11]
    assert stop.strip(), full
    cut = client.completions.create(**args, stop=[stop, "never-seen"]).choices[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop"
    one = client.completions.create(**args, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in one) == cut.text


def test_logprobs_are_the_grpc_paths_and_usage_counts_cached_tokens(
    router_cluster: RouterCluster,
    client: openai.OpenAI,
    corpus_ids: list[int],
    tokenizer: Tokenizer,
) -> None:
    prompt = corpus_ids[500:600]
    salt = _salt()
    args: dict[str, Any] = dict(model=router_cluster.model_id, prompt=prompt, max_tokens=6,
                                temperature=0, logprobs=0,
                                extra_body={"ignore_eos": True, **salt})  # fmt: skip
    cold = client.completions.create(**args)
    warm = client.completions.create(**args)
    grpc_out = generate(router_cluster.generation(0), **greedy_request(prompt, 6), logprobs=True)
    lp = cold.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    expected = [x for m in grpc_out.messages for x in m.logprobs]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-5)
    # each token's own text, special tokens included (the text skips them)
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False)
                         for t in grpc_out.token_ids]  # fmt: skip
    assert lp.top_logprobs is not None and [list(d) for d in lp.top_logprobs] == [
        [t] for t in lp.tokens
    ]
    assert cold.usage is not None and warm.usage is not None
    details = cold.usage.prompt_tokens_details, warm.usage.prompt_tokens_details
    assert details[0] is not None and details[1] is not None
    assert details[0].cached_tokens == 0
    assert details[1].cached_tokens is not None and details[1].cached_tokens >= len(prompt) // 2

    chat = client.chat.completions.create(
        model=router_cluster.model_id, messages=[{"role": "user", "content": "The river"}],
        max_completion_tokens=4, temperature=0, logprobs=True, top_logprobs=0,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert all(c.logprob <= 0 and c.top_logprobs == [] for c in content)


def _prefix_cache_hits(rc: RouterCluster) -> int:
    return sum(load.engine.num_cache_hit_tokens for load in rc.loads().values())
