"""Chat messages → prompt text, with the checkpoint's own chat template.

The template is the one the checkpoint ships (`chat_template` in tokenizer_config.json, or
the chat_template.jinja beside it) and it is rendered by transformers' tokenizer
(`apply_chat_template`: its sandboxed Jinja environment, filters and globals), so a prompt is
exactly what the model's authors format and what transformers users get. A checkpoint
without one has no chat API: `ChatTemplate.from_model_dir` returns None and chat requests
are refused (400) saying so.

The rendered text already holds the template's special tokens (a BOS among them): it is
tokenized without adding any. `template_messages` turns the request's messages into what a
template takes: roles system (`developer` is read as system), user, assistant, and text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from router.http.protocol import ChatMessage
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

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt for `messages` (role and text content each), ending where the
        assistant's answer starts. A template that refuses them (many raise on roles that
        do not alternate) is an InvalidRequest naming `messages`."""
        from jinja2 import TemplateError

        try:
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except TemplateError as e:
            raise InvalidRequest("messages", f"the model's chat template refused them: {e}") from e
        return str(text)


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as a chat template takes them: role and the text of the content
    (InvalidRequest naming the message and field that pdserve cannot take)."""
    if not messages:
        raise InvalidRequest("messages", "must not be empty")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role in ("tool", "function"):
            raise InvalidRequest(f"{where}.role", f"{m.role!r} messages need tool calling, "
                                 "which is not supported")  # fmt: skip
        role = _ROLES.get(m.role)
        if role is None:
            raise InvalidRequest(
                f"{where}.role", f"must be system, developer, user or assistant, got {m.role!r}"
            )
        extra = m.model_extra or {}
        for name in ("tool_calls", "function_call"):
            if extra.get(name):
                raise InvalidRequest(f"{where}.{name}", "tool calling is not supported")
        message = {"role": role, "content": _content(where, role, m.content)}
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
