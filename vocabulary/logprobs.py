"""Log-probabilities a request asked for, as they cross the engine's boundary (torch-free):
a token's most likely alternatives (`TopLogprobs`) and the prompt's own log-probabilities
(`PromptLogprobs`, OpenAI's `echo` with `logprobs`).

Every value is from the model's raw distribution (log-softmax of the logits before any
processing: no temperature, penalties or bias), as vLLM v1 reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20
"""Most alternatives one token may report (OpenAI's chat limit; vLLM's default cap)."""


@dataclass(frozen=True)
class TopLogprobs:
    """The k most likely tokens at one position, most likely first."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


NO_TOP = TopLogprobs((), ())
"""No alternatives (a position that has none to report: the prompt's first token)."""


@dataclass(frozen=True)
class PromptLogprobs:
    """Per prompt token, its log-probability given the tokens before it and the top-k
    alternatives at its position. The first token has neither (`logprobs[0]` is None,
    `top[0]` is `NO_TOP`); both tuples have one entry per prompt token."""

    logprobs: tuple[float | None, ...]
    top: tuple[TopLogprobs, ...]
