"""Structured output: a request's `StructuredOutput` (vocabulary/sampling.py) compiled to a
grammar over this checkpoint's vocabulary, and one matcher per request that says, step by
step, which tokens may come next.

The library is xgrammar (JSON schema, any JSON, regex, EBNF; what vLLM, SGLang and
TensorRT-LLM use). How a request goes:

    compile    `Grammars.compile` on a pool of its own threads, never the engine thread: the
               worker awaits it before it hands the request to the engine (a request waits
               for its own compile, the others never do); a compile error or one over
               `grammar_compile_timeout_s` is a SamplingParamsError naming
               `structured_output`, with the compiler's words. Compiled grammars stay in an
               LRU cache keyed by the constraint (the tokenizer is the engine's, fixed), at
               most `grammar_cache_size` of them.
    match      `Grammars.matcher` gives a fresh matcher over the compiled grammar; the
               engine feeds it every token the request has (a migrated request's prior
               tokens, the first token a prefill worker sampled) and then each new one.
    mask       before a step samples, the engine fills each constrained row's bitmask on
               the host (`fill_masks`) while the device runs the step's model, and the
               sampler applies it on the device (`apply_token_bitmask`).

Disaggregated: the hand-off carries nothing new. The decode worker compiles the same
constraint (it travels in SamplingParams) and replays the tokens accepted so far into a fresh
matcher, which is exactly the state the prefill worker had; migration does the same.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vocabulary.sampling import SamplingParamsError, StructuredOutput
from vocabulary.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

FIELD = "structured_output"
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[23:14:11] /project/cpp/x.cc:94: "


@dataclass(frozen=True)
class TokenMask:
    """The tokens a step's constrained rows may sample (the sampler applies it)."""

    rows: tuple[int, ...]
    """Rows of the step's logits the mask covers."""
    bitmask: torch.Tensor
    """int32 [len(rows), ceil(vocab / 32)] on the host: bit j of word w allows token 32 w + j."""


class Grammars:
    """Compiled constraints for one tokenizer, and matchers over them (thread-safe)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        cache_size: int = 256,
        compile_timeout_s: float = 10.0,
        threads: int = 2,
    ) -> None:
        """`vocab_size`: the model's (the logits' width, which may exceed the tokenizer's)."""
        import xgrammar as xgr  # imported with the first constrained request (it brings triton)
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf)
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[StructuredOutput, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s

    def compile(self, constraint: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of `constraint`, from the cache or compiled now on the pool
        (waits at most `compile_timeout_s`); SamplingParamsError if it does not compile."""
        with self._lock:
            future = self._cache.get(constraint)
            if future is None:
                future = self._pool.submit(self._compile, constraint)
                self._cache[constraint] = future
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(constraint)
        try:
            return future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            raise SamplingParamsError(
                FIELD, f"{constraint.kind}: did not compile within {self.compile_timeout_s:g} s"
            ) from None
        except SamplingParamsError:
            with self._lock:  # a failure is not kept: the next request gets the error anew
                if self._cache.get(constraint) is future:
                    del self._cache[constraint]
            raise

    def compiled(self, constraint: StructuredOutput) -> bool:
        """Whether `constraint`'s compile has finished and succeeded (a failure is not kept)."""
        with self._lock:
            future = self._cache.get(constraint)
        return future is not None and future.done() and future.exception() is None

    def matcher(self, constraint: StructuredOutput) -> xgr.GrammarMatcher:
        """A fresh matcher (no tokens accepted) over `constraint`'s compiled grammar."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(constraint))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, constraint: StructuredOutput) -> xgr.CompiledGrammar:
        compiler = self._compiler
        kind, spec = constraint.kind, constraint.spec
        try:
            if kind == "json_schema":
                try:
                    schema = json.loads(spec)
                except json.JSONDecodeError as e:
                    raise SamplingParamsError(FIELD, f"json_schema: not JSON ({e})") from None
                if not isinstance(schema, dict | bool):
                    raise SamplingParamsError(FIELD, "json_schema: a schema is a JSON object")
                return compiler.compile_json_schema(
                    spec, any_whitespace=False, strict_mode=constraint.strict
                )
            if kind == "json_object":  # an object (xgrammar's builtin JSON allows any value)
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "grammar":
                return compiler.compile_grammar(spec)
            return compiler.compile_grammar(choice_grammar(constraint.choices))
        except SamplingParamsError:
            raise
        except Exception as e:  # the compiler's own words (RuntimeError, ValueError, ...)
            message = _SOURCE_PREFIX.sub("", " ".join(str(e).split()))[:500]
            raise SamplingParamsError(FIELD, f"{kind}: does not compile: {message}") from None


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are valid
    EBNF literals in xgrammar's dialect)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def accept(matcher: xgr.GrammarMatcher, token_ids: Sequence[int]) -> bool:
    """Feed tokens to a matcher; False at the first one it refuses (nothing after it fed)."""
    return all(matcher.accept_token(t) for t in token_ids)


def fill_masks(matchers: Sequence[xgr.GrammarMatcher | None], vocab_size: int) -> torch.Tensor:
    """The int32 bitmask [len(matchers), ceil(vocab / 32)] of the tokens each matcher allows
    next (on the host); a row whose matcher is None (its request ended while the step was in
    flight: its token is discarded) allows every token."""
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    for row, matcher in enumerate(matchers):
        if matcher is not None and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(mask, row)
    return mask


_BITS: dict[torch.device, torch.Tensor] = {}  # arange(32) as int32, per device


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of `rows` (int64, on the logits' device) whose bit is
    0 in `bitmask` (int32 [len(rows), words], on the logits' device; bit j of word w is token
    32 w + j, xgrammar's layout)."""
    vocab = logits.shape[1]
    bits = _BITS.get(logits.device)
    if bits is None:
        bits = _BITS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(bitmask.shape[0], -1)
    picked = logits.index_select(0, rows)
    picked.masked_fill_(~allowed[:, :vocab], float("-inf"))
    logits.index_copy_(0, rows, picked)
