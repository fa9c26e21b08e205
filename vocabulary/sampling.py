"""How one request's tokens are chosen and when its generation stops (no torch: the router
validates with it too).

Defaults follow the public API (proto/pdserve/v1/serving.proto): temperature 1.0 (0 means
greedy), top_p 1.0, top_k 0 (all tokens), min_p 0, no penalties, no seed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vocabulary.logprobs import MAX_TOP_LOGPROBS

MAX_LOGIT_BIAS = 1024
"""Most tokens one request may bias (each is an indexed add on its logits row)."""
LOGIT_BIAS_RANGE = (-100.0, 100.0)
"""A bias's bounds (OpenAI's)."""
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
"""What a `StructuredOutput` constrains the output to (see its fields)."""
MAX_STRUCTURED_SPEC_CHARS = 65536
"""Longest schema, regex, grammar or choice list a request may carry (the router's
`max_structured_spec_chars` may lower it)."""
MAX_CHOICES = 1024
"""Most alternatives of a `choice` constraint."""


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message starts with the field's name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type[SamplingParamsError], tuple[str, str]]:
        # raised in a worker (a grammar that does not compile) and re-raised in the router
        return type(self), (self.field, self.message)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output text, enforced token by token (a mask over the
    vocabulary each step, engine/structured/grammars.py):

        json_schema  `spec` is a JSON schema (its JSON text); `strict`: no properties beyond
                     those declared (OpenAI's strict; false lets the schema's own
                     additionalProperties decide)
        json_object  any JSON object (`spec` empty)
        regex        `spec` is a regular expression the whole output matches
        grammar      `spec` is an EBNF grammar (GBNF-like, rule `root` first: xgrammar's dialect)
        choice       exactly one of `choices`

    The output ends when the constraint is complete (finish reason stop) or at max_tokens
    (length, the text then a prefix of a valid one)."""

    kind: str
    spec: str = ""
    strict: bool = True
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        field = "structured_output"
        if self.kind not in STRUCTURED_KINDS:
            raise SamplingParamsError(
                field, f"kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}"
            )
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind == "choice":
            if not self.choices or len(self.choices) > MAX_CHOICES:
                raise SamplingParamsError(
                    field, f"choice: 1 to {MAX_CHOICES} alternatives, got {len(self.choices)}"
                )
            if any(not isinstance(c, str) or not c for c in self.choices):
                raise SamplingParamsError(field, "choice: each alternative a non-empty string")
        elif self.choices:
            raise SamplingParamsError(field, f"choices are for kind choice, not {self.kind}")
        if self.kind in ("json_schema", "regex", "grammar") and not self.spec:
            raise SamplingParamsError(field, f"{self.kind}: empty")
        if self.kind == "json_object" and self.spec:
            raise SamplingParamsError(field, "json_object takes no spec")
        size = len(self.spec) + sum(len(c) for c in self.choices)
        if size > MAX_STRUCTURED_SPEC_CHARS:
            raise SamplingParamsError(
                field, f"{self.kind}: {size} characters, at most {MAX_STRUCTURED_SPEC_CHARS}"
            )


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping settings of one request (validated on construction)."""

    max_tokens: int = 16
    """Tokens to generate, >= 1 (the first one comes from prefill)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability mass reaches top_p."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely token; 0 disables."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens seen in the prompt or output (divides positive logits,
    multiplies negative ones, as in transformers); 1 disables."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI semantics)."""
    frequency_penalty: float = 0.0
    """Subtracted once per earlier occurrence of a token in the output."""
    seed: int | None = None
    """Per-request seed: the same seed and inputs give the same tokens."""
    stop: tuple[str, ...] = ()
    """Stop strings, matched on the detokenized output; not included in the returned text."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end generation; included in the returned token ids."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence tokens."""
    logprobs: bool = False
    """Return the log-probability of each chosen token (from the model's raw distribution)."""
    top_logprobs: int = 0
    """Also return the k most likely tokens at each generated position, with their raw
    log-probabilities (0..20); > 0 implies `logprobs`."""
    prompt_logprobs: int | None = None
    """Return each prompt token's raw log-probability and the k most likely tokens at its
    position (0..20); None: none. The prompt is then computed in full (no prefix-cache hits)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) added to those tokens' logits before penalties and sampling (greedy
    too), OpenAI's semantics: -100 all but bans a token, +100 all but forces it. Given as a
    mapping or pairs; stored sorted by token id."""
    structured: StructuredOutput | None = None
    """Constrain the output to a JSON schema, a regex, a grammar or a choice (None: free)."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise SamplingParamsError("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingParamsError("top_k", f"must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise SamplingParamsError(
                "repetition_penalty", f"must be > 0, got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise SamplingParamsError(name, f"must be in [-2, 2], got {value}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingParamsError(
                "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingParamsError(
                "prompt_logprobs",
                f"must be in [0, {MAX_TOP_LOGPROBS}] or unset, got {self.prompt_logprobs}",
            )
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise SamplingParamsError("seed", f"must be in [0, 2**64), got {self.seed}")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", "token ids must be >= 0")
        # Accept lists from callers but store tuples (the dataclass stays hashable).
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        """The chosen tokens' logprobs are returned (asked for, or implied by top_logprobs)."""
        return self.logprobs or self.top_logprobs > 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string (0 without stop strings)."""
        return max((len(s) for s in self.stop), default=0)


def _logit_bias(
    given: Mapping[int, float] | Iterable[tuple[int, float]],
) -> tuple[tuple[int, float], ...]:
    try:
        pairs = [(token, bias) for token, bias in (
            given.items() if isinstance(given, Mapping) else given
        )]  # fmt: skip
    except (TypeError, ValueError):
        raise SamplingParamsError(
            "logit_bias", "a mapping of token id to bias, or (token id, bias) pairs"
        ) from None
    if len(pairs) > MAX_LOGIT_BIAS:
        raise SamplingParamsError(
            "logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}"
        )
    low, high = LOGIT_BIAS_RANGE
    out: dict[int, float] = {}
    for token, bias in pairs:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise SamplingParamsError("logit_bias", f"token ids must be ints >= 0, got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise SamplingParamsError("logit_bias", f"token {token}: bias must be a number")
        if not (math.isfinite(bias) and low <= bias <= high):
            raise SamplingParamsError(
                "logit_bias", f"token {token}: bias must be in [{low:g}, {high:g}], got {bias}"
            )
        if token in out:
            raise SamplingParamsError("logit_bias", f"token {token} is given twice")
        out[token] = float(bias)
    return tuple(sorted(out.items()))
