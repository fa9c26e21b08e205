"""The request bodies of the OpenAI-compatible API, as pydantic models.

Shapes only: a field that has the wrong JSON type fails here (400 naming it, see
router/http/errors.py); what a value means (ranges, lengths, the vocabulary, the context) is
checked by the same `router.validation.validate` that checks gRPC requests
(router/http/translate.py). Fields that OpenAI defines and pdserve cannot honour (`audio`,
`prediction`, ...) land in `model_extra` with every unknown field; the
translation refuses the first ones by name and ignores the rest, as OpenAI ignores unknown
fields.

Extensions beside OpenAI's fields, with vLLM's names: `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `priority`, `cache_salt`,
`return_token_ids`, and structured output as vLLM takes it (`structured_outputs`, the older
`guided_*`). Chat bodies carry OpenAI's tool calling (`tools`, `tool_choice`,
`parallel_tool_calls`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool | None = None
    """Send one last chunk, before `[DONE]`, with empty choices and the usage."""


class GenerationBody(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    stop: Any = None
    """A string or a list of strings (checked by the translation, to name the field)."""
    seed: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    """Token id (a string, as JSON keys are) → bias in [-100, 100]."""
    user: StrictStr | None = None
    """The end user, for the client's own monitoring; accepted, no effect on the output."""
    # extensions
    top_k: StrictInt | None = None
    """Keep the k most likely tokens; 0 or -1: all."""
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    priority: StrictInt | None = None
    cache_salt: StrictStr | None = None
    return_token_ids: StrictBool | None = None
    """Add `token_ids` (and `prompt_token_ids`) to each choice (each chunk's new ones)."""
    # structured output (router/http/structured.py reads the shapes, to name the field)
    response_format: Any = None
    """OpenAI's: `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}`."""
    structured_outputs: Any = None
    """vLLM's: one of `json` (a schema), `json_object`, `regex`, `choice`, `grammar`."""
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    """vLLM's older names of the same (one at most)."""


class CompletionRequest(GenerationBody):
    """POST /v1/completions."""

    prompt: Any = None
    """A string, a list of strings, a list of token ids or a list of lists of token ids."""
    logprobs: StrictInt | None = None
    """The log-probability of each sampled token and its N most likely alternatives
    (0..20; OpenAI allows 5, vLLM 20)."""
    echo: StrictBool | None = None
    """Return the prompt before the completion (with `logprobs`, the prompt's logprobs too);
    `max_tokens: 0` then generates nothing."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: Any = None
    """A string, or a list of content parts of which only `text` ones are supported."""
    name: StrictStr | None = None
    tool_calls: Any = None
    """An assistant's: the calls it made (router/http/tools.py reads the shapes)."""
    tool_call_id: StrictStr | None = None
    """A `tool` message's: the call it answers."""


class ChatCompletionRequest(GenerationBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    """The N most likely alternatives of each token (0..20; needs `logprobs: true`)."""
    # tool calling (router/http/tools.py reads the shapes, to name the field)
    tools: Any = None
    """Function tools: `{"type": "function", "function": {"name", "description",
    "parameters"}}` each."""
    tool_choice: Any = None
    """"none", "auto" (the default with tools), "required" or `{"type": "function",
    "function": {"name": ...}}`."""
    parallel_tool_calls: Any = None
    """Whether one answer may call several tools (default true)."""
