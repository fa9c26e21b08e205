"""Chat messages → prompt text, with the checkpoint's own chat template.

The template is the one the checkpoint ships (`chat_template` in tokenizer_config.json, or
the chat_template.jinja beside it) and it is rendered by transformers' tokenizer
(`apply_chat_template`: its sandboxed Jinja environment, filters and globals), so a prompt is
exactly what the model's authors format and what transformers users get. A checkpoint
without one has no chat API: `ChatTemplate.from_model_dir` returns None and chat requests
are refused (400) saying so.

The rendered text already holds the template's special tokens (a BOS among them): it is
tokenized without adding any. `template_messages` turns the request's messages into what a
template takes: roles system (`developer` is read as system), user, assistant (with its
`tool_calls`), tool (with its `tool_call_id`), and text. The request's tools reach the
template as transformers passes them (`tools=`, OpenAI's tool objects).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from router.http.protocol import ChatMessage
from router.http.tools import assistant_tool_calls
from router.validation import InvalidRequest


class ChatTemplate:
    """One checkpoint's chat template (rendering only; no tokenizing)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The template of the checkpoint at `model_dir`; None when it has none."""
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
        if not tokenizer.chat_template:
            return None
        return cls(tokenizer)

    def render(
        self, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> str:
        """The prompt for `messages` (role and text content each) and `tools` (None: no
        tools section), ending where the assistant's answer starts. A template that refuses
        them (many raise on roles that do not alternate) is an InvalidRequest naming
        `messages`."""
        from jinja2 import TemplateError

        try:
            text = self._tokenizer.apply_chat_template(
                messages, tools=list(tools) if tools else None, tokenize=False,
                add_generation_prompt=True,
            )  # fmt: skip
        except TemplateError as e:
            raise InvalidRequest("messages", f"the model's chat template refused them: {e}") from e
        return str(text)


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}  # fmt: skip


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a chat template takes them: role and the text of the content
    (InvalidRequest naming the message and field that pdserve cannot take)."""
    if not messages:
        raise InvalidRequest("messages", "must not be empty")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = _ROLES.get(m.role)
        if role is None:
            raise InvalidRequest(f"{where}.role", "must be system, developer, user, assistant or "
                                 f"tool, got {m.role!r}")  # fmt: skip
        if (m.model_extra or {}).get("function_call"):
            raise InvalidRequest(f"{where}.function_call", "the legacy function_call is not "
                                 "supported (tool_calls is)")  # fmt: skip
        calls = m.tool_calls not in (None, [])
        if calls and role != "assistant":
            raise InvalidRequest(f"{where}.tool_calls", "only assistant messages carry them")
        message: dict[str, Any] = {"role": role, "content": _content(where, role, m.content)}
        if calls:
            message["tool_calls"] = assistant_tool_calls(f"{where}.tool_calls", m.tool_calls)
        if role == "tool":
            if m.tool_call_id is None:
                raise InvalidRequest(f"{where}.tool_call_id", "is required in a tool message")
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        out.append(message)
    return out


def _content(where: str, role: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content", "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise InvalidRequest(
                f"{where}.content[{j}].type", f"only text parts are supported, got {kind!r}"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"{where}.content[{j}].text", "must be a string")
        texts.append(text)
    return "\n".join(texts)
