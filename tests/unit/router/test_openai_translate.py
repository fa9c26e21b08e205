"""OpenAI bodies → the orchestrator's requests (router/http/translate.py): prompt shapes,
siblings and their seeds, defaults, the names errors use, the fields pdserve refuses and the
values of them that pass, headers, chat messages; and the tiny model's chat template as
transformers renders it. Exact answers on hand-made inputs (no cluster)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from router.http.chat import ChatTemplate, template_messages
from router.http.errors import ApiError
from router.http.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from router.http.translate import (
    MAX_CHOICES,
    REQUEST_ID_HEADER,
    TENANT_HEADER,
    TIMEOUT_HEADER,
    Endpoint,
    GenerationPlan,
    Translator,
)
from router.validation import InvalidRequest, ValidationLimits
from vocabulary.sampling import StructuredOutput

MODEL = "tiny"
LIMITS = ValidationLimits(max_model_len=64, vocab_size=100, tenants=frozenset({"", "acme"}),
                          max_sequence_tokens=48)  # fmt: skip


class CharTokenizer:
    """One token per character (code point mod 100); BOS 1 when special tokens are added."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) % 100 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in ids)


class Template:
    """A chat template that writes `role:content|` per message (what the translator sends
    it is what these tests check)."""

    def __init__(self) -> None:
        self.seen: list[list[dict[str, Any]]] = []
        self.tools: list[Any] = []

    def render(self, messages: list[dict[str, Any]], tools: Any = None) -> str:
        self.seen.append(messages)
        self.tools.append(tools)
        return "".join(f"{m['role']}:{m['content']}|" for m in messages)


def translator(template: Template | None = None) -> Translator:
    return Translator(MODEL, CharTokenizer(), template, lambda: LIMITS)  # type: ignore[arg-type]


def completion(headers: dict[str, str] | None = None, **body: Any) -> GenerationPlan:
    return translator().completion(
        CompletionRequest.model_validate({"model": MODEL, **body}), headers or {}
    )


def chat(template: Template | None = None, **body: Any) -> GenerationPlan:
    return translator(template or Template()).chat(
        ChatCompletionRequest.model_validate({"model": MODEL, **body}), {}
    )


def refused(fn: Any, *args: Any, **kwargs: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        fn(*args, **kwargs)
    return err.value


def test_each_prompt_shape_gives_its_prompts_with_n_siblings_each() -> None:
    text = completion(prompt="ab")
    assert [c.request.prompt_token_ids for c in text.choices] == [(1, 97, 98)]
    assert text.choices[0].request.sampling.max_tokens == 16  # OpenAI's default
    ids = completion(prompt=[5, 6, 7], max_tokens=3)
    assert ids.choices[0].request.prompt_token_ids == (5, 6, 7)
    plan = completion(prompt=[[5], [6, 7]], n=3, seed=10, max_tokens=2)
    assert [(c.index, c.prompt_index) for c in plan.choices] == [
        (0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1),
    ]  # fmt: skip
    assert [c.request.sampling.seed for c in plan.choices] == [10, 11, 12, 10, 11, 12]
    assert [c.request.prompt_token_ids for c in plan.choices] == [(5,)] * 3 + [(6, 7)] * 3
    strings = completion(prompt=["a", "b"], n=2)
    assert [c.request.prompt_token_ids for c in strings.choices] == [(1, 97)] * 2 + [(1, 98)] * 2
    no_seed = completion(prompt="a", n=2)
    assert [c.request.sampling.seed for c in no_seed.choices] == [None, None]
    top = completion(prompt="a", seed=2**64 - 1, n=2)
    assert [c.request.sampling.seed for c in top.choices] == [2**64 - 1, 0]


def test_errors_name_the_bodys_field() -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"prompt": [3, 100]}, "prompt", "id 100 is outside the vocabulary [0, 100)"),
        ({"prompt": [[3], [4, 200]]}, "prompt[1]", "id 200 is outside the vocabulary"),
        ({"prompt": ["a", ""]}, "prompt[1]", "must not be empty"),
        ({"prompt": [1, -2]}, "prompt", "id -2 is not a token id"),
        ({"prompt": [True, 1]}, "prompt", "must be a string, a list of strings"),
        ({"prompt": {"text": "a"}}, "prompt", "must be a string"),
        ({}, "prompt", "is required"),
        ({"prompt": []}, "prompt", "must not be empty"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens", "0 only with echo: true), got 0"),
        ({"prompt": "a", "max_tokens": -4}, "max_tokens", "must be >= 1, got -4"),
        ({"prompt": "a", "max_tokens": 2**32}, "max_tokens", "must be in [0, 4294967295]"),
        ({"prompt": "a", "max_tokens": 63}, "max_tokens", "exceeds the context length of 64"),
        ({"prompt": "a", "top_k": -2}, "top_k", "must be in [0,"),
        ({"prompt": "a", "seed": -1}, "seed", "must be in [0, 2**64)"),
        ({"prompt": "a", "priority": 11}, "priority", "must be in [-10, 10], got 11"),
        ({"prompt": "a", "stop": [1]}, "stop", "must be a string or a list of strings"),
        ({"prompt": "a", "stop": "x\x00"}, "stop", "control character"),
        ({"prompt": "a", "temperature": -0.5}, "temperature", "must be >= 0"),
        ({"prompt": "a", "n": 0}, "n", "must be >= 1, got 0"),
        ({"prompt": ["a", "b"], "n": 33}, "n", f"more than {MAX_CHOICES} per request"),
        ({"prompt": "a", "logprobs": 21}, "logprobs", "must be in [0, 20], got 21"),
        (
            {"prompt": "a", "stream_options": {"include_usage": True}},
            "stream_options",
            "only allowed when stream is true",
        ),
    ]
    for body, field, words in cases:
        err = refused(completion, **body)
        assert (err.field, str(err).startswith(f"{field}: ")) == (field, True), (body, err)
        assert words in str(err), (body, err)


def test_headers_give_the_request_id_tenant_and_deadline() -> None:
    plan = completion({REQUEST_ID_HEADER: "abc-1", TENANT_HEADER: "acme",
                       TIMEOUT_HEADER: "2.5"}, prompt="a")  # fmt: skip
    request = plan.choices[0].request
    assert (request.request_id, request.tenant, plan.timeout_s) == ("abc-1", "acme", 2.5)
    assert plan.response_id == "cmpl-abc-1"
    assert completion(prompt="a").timeout_s is None
    for headers, field in [({TENANT_HEADER: "other"}, TENANT_HEADER),
                           ({REQUEST_ID_HEADER: "a b"}, REQUEST_ID_HEADER),
                           ({TIMEOUT_HEADER: "0"}, TIMEOUT_HEADER),
                           ({TIMEOUT_HEADER: "inf"}, TIMEOUT_HEADER)]:  # fmt: skip
        assert refused(completion, headers, prompt="a").field == field


def test_sampling_fields_and_extensions_reach_the_request() -> None:
    # (the floats are exact in float32, the proto's type)
    plan = completion(
        prompt="a", max_tokens=5, temperature=0.5, top_p=0.75, top_k=7, min_p=0.125,
        repetition_penalty=1.25, presence_penalty=0.5, frequency_penalty=-0.5, seed=3,
        stop="zz", stop_token_ids=[2], ignore_eos=True, priority=-2, cache_salt="s1",
        logprobs=0, stream=True, stream_options={"include_usage": True},
        return_token_ids=True, user="someone",
    )  # fmt: skip
    r = plan.choices[0].request
    s = r.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (5, 0.5, 0.75, 7, 0.125)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.25, 0.5, -0.5)
    assert (s.seed, s.stop, s.stop_token_ids, s.ignore_eos, s.logprobs) == (
        3, ("zz",), (2,), True, True,
    )  # fmt: skip
    assert (r.priority, r.cache_salt) == (-2, "s1")
    assert (plan.stream, plan.include_usage, plan.logprobs, plan.return_token_ids) == (
        True, True, True, True,
    )  # fmt: skip
    unset = completion(prompt="a", top_k=-1).choices[0].request.sampling
    assert (unset.temperature, unset.top_p, unset.top_k, unset.logprobs) == (1.0, 1.0, 0, False)


@pytest.mark.parametrize(
    ("field", "value"),
    [("tools", [{"type": "function"}]), ("tool_choice", "auto"), ("functions", [{}]),
     ("function_call", "auto"),
     ("audio", {"voice": "x"}), ("modalities", ["text", "audio"]),
     ("prediction", {"type": "content"}), ("web_search_options", {}),
     ("reasoning_effort", "low"), ("store", True), ("suffix", "x"),
     ("best_of", 2)],
)  # fmt: skip
def test_fields_pdserve_cannot_honour_are_refused_by_name(field: str, value: Any) -> None:
    err = refused(completion, prompt="a", **{field: value})
    assert err.field == field


def test_values_that_ask_for_nothing_and_unknown_fields_pass() -> None:
    plan = completion(prompt="a", tools=[], tool_choice="none", response_format={"type": "text"},
                      logit_bias={}, modalities=["text"], store=False, echo=False, suffix="",
                      best_of=1, parallel_tool_calls=True, metadata={"k": "v"},
                      service_tier="auto", some_future_field=3)  # fmt: skip
    assert len(plan.choices) == 1


def test_logit_bias_maps_token_id_keys_to_biases_and_names_a_bad_one() -> None:
    plan = completion(prompt="a", logit_bias={"7": 100, "3": -2.5})
    assert plan.choices[0].request.sampling.logit_bias == ((3, -2.5), (7, 100.0))
    for bad in ({"x": 1}, {"-1": 1}, {" 7": 1}, {"²": 1}, {"9" * 40: 1}, {"7": "high"},
                {"7": 101}):  # fmt: skip
        assert refused(completion, prompt="a", logit_bias=bad).field == "logit_bias"


def test_an_unknown_model_is_404() -> None:
    with pytest.raises(ApiError) as err:
        completion(prompt="a", model="gpt-4o")
    f = err.value.failure
    assert (f.status, f.param, f.code) == (404, "model", "model_not_found")


def test_an_adapters_name_as_the_model_generates_with_it_and_the_base_name_without() -> None:
    t = Translator(MODEL, CharTokenizer(), None, lambda: LIMITS, lambda: {"sql"})  # type: ignore[arg-type]
    plan = t.completion(CompletionRequest.model_validate({"model": "sql", "prompt": "a"}), {})
    assert (plan.model, plan.choices[0].request.lora) == ("sql", "sql")
    plan = t.completion(CompletionRequest.model_validate({"model": MODEL, "prompt": "a"}), {})
    assert (plan.model, plan.choices[0].request.lora) == (MODEL, "")
    with pytest.raises(ApiError) as err:
        t.completion(CompletionRequest.model_validate({"model": "sq", "prompt": "a"}), {})
    assert (err.value.failure.status, err.value.failure.code) == (404, "model_not_found")


def test_chat_messages_reach_the_template_and_the_prompt_is_not_given_a_second_bos() -> None:
    template = Template()
    plan = chat(template, messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "name": "ann"},
        {"role": "assistant", "content": None},
    ])  # fmt: skip
    assert template.seen == [[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "content": ""},
    ]]  # fmt: skip
    rendered = "system:be brief|user:a\nb|assistant:|"
    request = plan.choices[0].request
    assert request.prompt_token_ids == tuple(ord(c) % 100 for c in rendered)
    # No max_tokens: what the smallest decode pool (48 tokens) leaves after the prompt.
    assert request.sampling.max_tokens == 48 - len(rendered)
    assert plan.endpoint is Endpoint.CHAT and plan.response_id.startswith("chatcmpl-")


def test_chat_errors_name_the_message_and_field() -> None:
    user = {"role": "user", "content": "hi"}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
        ({"messages": [user, {"role": "critic", "content": "x"}]}, "messages[1].role"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages[0].content[0].text",
        ),
        (
            {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
            "messages[0].tool_calls[0].function",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}]},
            "messages[0].tool_calls",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "1", "function": {"name": "f", "arguments": {"a": 1}}}
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"messages": [{"role": "assistant", "content": "x", "function_call": {"name": "f"}}]},
            "messages[0].function_call",
        ),
        ({"messages": [user], "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": [user], "max_tokens": 60}, "max_tokens"),
        ({"messages": [user], "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": [user], "echo": True}, "echo"),
        ({"messages": [user], "top_logprobs": 0}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x" * 60}]}, "messages"),
    ]
    for body, field in cases:
        assert refused(chat, **body).field == field, body


def test_chat_without_a_template_is_refused_saying_so() -> None:
    err = refused(
        translator(None).chat,
        ChatCompletionRequest.model_validate(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        ),
        {},
    )
    assert err.field == "messages" and "has no chat template" in str(err)


def test_the_tiny_models_template_renders_as_transformers_does(tiny_model_dir: Path) -> None:
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    assert template is not None
    text = template.render([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Tell a story."},
                            {"role": "assistant", "content": "Once."},
                            {"role": "user", "content": "More"}])  # fmt: skip
    assert text == (
        "<|begin_of_text|>Be brief.\n\nUser: Tell a story.\nAssistant: Once.<|end_of_text|>\n"
        "User: More\nAssistant:"
    )
    err = refused(template.render, [{"role": "critic", "content": "x"}])
    assert err.field == "messages" and "roles are system, user, assistant or tool" in str(err)


def test_the_tiny_models_template_renders_tools_calls_and_results(tiny_model_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    template = ChatTemplate.from_model_dir(tiny_model_dir)
    assert template is not None
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Now",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    text = template.render(template_messages([ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "?"}]},
    ]]), tools)  # fmt: skip
    assert text == (
        '<|begin_of_text|>Tools (call them by answering with a JSON array of calls, [{"name": '
        '..., "arguments": {...}}]):\n{"name": "get_weather", "description": "Now", "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string"}}}}\n\n'
        "User: Paris?\n"
        'Assistant: [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": not json}]<|end_of_text|>\n'
        "Tool: sunny\nTool: ?\nAssistant:"
    )
    hf = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))
    messages = [{"role": "user", "content": "Paris?"}]
    assert template.render(messages, tools) == hf.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    # no tools: no section, the rendering it always had
    assert template.render(messages, []) == "<|begin_of_text|>User: Paris?\nAssistant:"


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("body", "want"),
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": SCHEMA}}}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": SCHEMA, "strict": False}}},
         StructuredOutput("json_schema", json.dumps(SCHEMA), strict=False)),
        ({"structured_outputs": {"json": SCHEMA}},
         StructuredOutput("json_schema", json.dumps(SCHEMA))),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}},
         StructuredOutput("json_schema", json.dumps(SCHEMA))),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutput("regex", "a+")),
        ({"structured_outputs": {"choice": ["x", "y"]}},
         StructuredOutput("choice", choices=("x", "y"))),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}},
         StructuredOutput("grammar", 'root ::= "a"')),
        ({"guided_json": SCHEMA}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
        ({"guided_regex": "[0-9]+"}, StructuredOutput("regex", "[0-9]+")),
        ({"guided_choice": ["a"]}, StructuredOutput("choice", choices=("a",))),
        ({"guided_grammar": 'root ::= "b"'}, StructuredOutput("grammar", 'root ::= "b"')),
        ({"response_format": {"type": "text"}}, None),
    ],
)  # fmt: skip
def test_each_way_to_ask_for_structured_output_gives_its_constraint(
    body: dict[str, Any], want: StructuredOutput | None
) -> None:
    assert completion(prompt="a", **body).choices[0].request.sampling.structured == want
    assert (
        chat(messages=[{"role": "user", "content": "hi"}], **body)
        .choices[0]
        .request.sampling.structured
        == want
    )


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"response_format": {"type": "xml"}}, "response_format", "type"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA,
          "strict": "yes"}}}, "response_format", "strict"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
         "exactly one"),
        ({"structured_outputs": {"json": "{nope"}}, "structured_outputs", "not JSON"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "1 to 1024"),
        ({"structured_outputs": {"regex": "x" * 70000}}, "structured_outputs", "at most"),
        ({"guided_regex": 5}, "guided_regex", "a string"),
        ({"guided_choice": "a"}, "guided_choice", "list of strings"),
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "not several"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
         "not several"),
    ],
)  # fmt: skip
def test_a_bad_constraint_is_refused_naming_the_bodys_field(
    body: dict[str, Any], field: str, words: str
) -> None:
    err = refused(completion, prompt="a", **body)
    assert err.field == field and words in str(err), str(err)


def test_top_logprobs_and_echo_become_the_requests_logprob_fields() -> None:
    plain = completion(prompt="ab", logprobs=3).choices[0].request.sampling
    assert (plain.logprobs, plain.top_logprobs, plain.prompt_logprobs) == (True, 3, None)
    echo = completion(prompt="ab", logprobs=2, echo=True, max_tokens=0)
    s = echo.choices[0].request.sampling
    assert (s.top_logprobs, s.prompt_logprobs, s.max_tokens) == (2, 2, 1)
    assert (echo.echo, echo.echo_texts, echo.discard_output) == (True, ("ab",), True)
    text_only = completion(prompt=[1, 2], echo=True)
    assert text_only.choices[0].request.sampling.prompt_logprobs is None
    assert not text_only.discard_output
    chat_plan = chat(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=20)
    assert chat_plan.choices[0].request.sampling.top_logprobs == 20
