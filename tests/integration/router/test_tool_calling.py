"""Tool calling through the real cluster with the `openai` SDK: the tiny model at temperature 1
over many seeds, `tool_choice` required and a named function always answer with calls whose
arguments parse and validate against the declared parameters (`jsonschema`), whole and
streamed (the SDK assembles the deltas), disaggregated (router 0) and prefilled on the decode
worker (router 1); `auto` answers with text or with calls that validate; a conversation with
an assistant's calls and the tools' results renders and completes."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from router_harness import RouterCluster

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -99, "maximum": 99},
        "b": {"type": "integer", "minimum": -99, "maximum": 99},
    },
    "required": ["a", "b"],
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b",
                                      "parameters": ADD}},
]  # fmt: skip
PARAMETERS = {"get_weather": WEATHER, "add": ADD}
MAX_TOKENS = 500  # room for 8 calls of ~50 tokens beside a ~480-token prompt


def _salt() -> dict[str, Any]:
    return {"cache_salt": uuid.uuid4().hex}


def _answer(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[Any, str | None]:
    """(the message, the finish reason), whole or assembled from the stream's chunks by the
    SDK's own stream state (what `client.chat.completions.stream` uses)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    if not stream:
        out = client.chat.completions.create(**kwargs)
        return out.choices[0].message, out.choices[0].finish_reason
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        state.handle_chunk(chunk)
    (choice,) = state.current_completion_snapshot.choices
    return choice.message, choice.finish_reason


def _validate_calls(message: Any, names: set[str], most: int | None = None) -> list[str]:
    calls = message.tool_calls or []
    assert calls and message.content is None, message
    assert most is None or len(calls) <= most
    assert len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    return [c.function.name for c in calls]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_always_call_tools_that_validate_streamed_or_not(
    router_cluster: RouterCluster, clients: list[openai.OpenAI], choice: str
) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    tool_choice: Any = "required" if choice == "required" else named
    names = {"get_weather", "add"} if choice == "required" else {"add"}

    def answer(seed: int) -> tuple[Any, str | None]:
        router, stream, parallel = seed % 2, seed % 3 == 0, seed % 4 != 1
        kwargs: dict[str, Any] = dict(
            model=router_cluster.model_id,
            messages=[{"role": "user", "content": "What is the weather in Paris, and 2 + 3?"}],
            tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel,
            temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, extra_body=_salt(),
        )  # fmt: skip
        return _answer(clients[router], stream, **kwargs)

    seeds = range(12)
    # three at a time: each reserves ~62 of the decode worker's 256 KV blocks
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(answer, seeds))
    seen: set[str] = set()
    for seed, (message, reason) in zip(seeds, answers, strict=True):
        assert reason == "tool_calls", (seed, message)
        most = None if seed % 4 != 1 and choice == "required" else 1
        seen.update(_validate_calls(message, names, most))
    assert seen == names  # required: the model picks either tool over the seeds
    router_cluster.wait_idle()


def test_auto_answers_with_text_or_calls_that_validate(
    router_cluster: RouterCluster, clients: list[openai.OpenAI]
) -> None:
    for seed in range(6):
        stream = seed % 2 == 1
        kwargs: dict[str, Any] = dict(
            model=router_cluster.model_id,
            messages=[{"role": "user", "content": "Tell me about the weather."}],
            tools=TOOLS, temperature=1.0, seed=seed, max_tokens=40, extra_body=_salt(),
        )  # fmt: skip
        message, reason = _answer(clients[seed % 2], stream, **kwargs)
        if message.tool_calls:
            assert reason == "tool_calls"
            _validate_calls(message, {"get_weather", "add"})
        else:
            assert reason in ("stop", "length") and isinstance(message.content, str)
    # "none": text, never calls (the tools are still in the prompt)
    out = clients[0].chat.completions.create(
        model=router_cluster.model_id, messages=[{"role": "user", "content": "Hi"}],
        tools=TOOLS, tool_choice="none", temperature=1.0, seed=1, max_tokens=20,
    )  # fmt: skip
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason in ("stop", "length")
    router_cluster.wait_idle()


def test_a_conversation_with_calls_and_their_results_renders_and_completes(
    router_cluster: RouterCluster, clients: list[openai.OpenAI]
) -> None:
    from transformers import PreTrainedTokenizerFast

    first = clients[0].chat.completions.create(
        model=router_cluster.model_id,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS, tool_choice="required", temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
    )  # fmt: skip
    calls = first.choices[0].message.tool_calls or []
    assert calls
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        first.choices[0].message.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": c.id, "content": "sunny, 21"} for c in calls),
    ]
    for router, stream in ((0, False), (1, True)):
        kwargs: dict[str, Any] = dict(
            model=router_cluster.model_id, messages=messages, tools=TOOLS, temperature=0,
            max_tokens=8, extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        message, reason = _answer(clients[router], stream, **kwargs)
        assert reason == "length" and message.content
    out = clients[0].chat.completions.create(**kwargs)
    hf = PreTrainedTokenizerFast.from_pretrained(str(router_cluster.model_dir))
    rendered = hf.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert "Tool: sunny, 21\nAssistant:" in rendered and '[{"name": ' in rendered
    expected = hf(rendered, add_special_tokens=False)["input_ids"]
    assert (out.choices[0].model_extra or {})["prompt_token_ids"] == expected
    router_cluster.wait_idle()
