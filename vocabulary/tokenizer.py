"""Text ↔ token ids for one checkpoint, plus streaming detokenization (no torch: the router
imports this module).

`Tokenizer` wraps `tokenizers.Tokenizer.from_file(model_dir/tokenizer.json)`; `encode` adds
special tokens (BOS) the way the checkpoint's post-processor does, exactly as transformers'
`AutoTokenizer(...)(text)` would. `IncrementalDetokenizer` turns a stream of generated token
ids into UTF-8-safe text deltas: bytes of a character split across tokens are held back until
the character completes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


class Tokenizer:
    """The checkpoint's tokenizer (tokenizer.json) and its end-of-sequence ids."""

    def __init__(self, tokenizer: HFTokenizer, eos_token_ids: Sequence[int] = ()) -> None:
        self.hf = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json; eos ids come from generation_config.json, else config.json."""
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the checkpoint has no tokenizer.json")
        return cls(HFTokenizer.from_file(str(path)), _eos_ids(root))

    @property
    def vocab_size(self) -> int:
        return int(self.hf.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def detokenizer(self, prompt_token_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        """A streaming detokenizer for the tokens that follow `prompt_token_ids`."""
        return IncrementalDetokenizer(self, prompt_token_ids)


PROMPT_CONTEXT_TOKENS = 8
"""Prompt tokens the detokenizer keeps as context: enough for a decoder that drops a leading
space or a character split across tokens; not the whole prompt, whose first decode would
cost the engine thread ~0.4 ms per 1k tokens (`python -m benchmarks detokenize`)."""


class IncrementalDetokenizer:
    """Text deltas for generated tokens, one token at a time (special tokens skipped).

    The prompt's last PROMPT_CONTEXT_TOKENS tokens are context only (tokenizers whose
    decoders drop a leading space need it); its text is never returned. `push` returns ""
    while a multi-byte character is incomplete and the whole character once its last byte
    arrives. An id the tokenizer does not know (a model vocabulary larger than the
    tokenizer's: dummy weights over a stand-in tokenizer) has no text: it returns "" and is
    not kept, since a kept one stalls the stream's window, which then grows with every
    token (0.4 ms a token after a 2k prompt).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = tokenizer.vocab_size
        context = [t for t in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:] if t < self._vocab_size]
        self._stream = DecodeStream(ids=context, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        if not 0 <= token_id < self._vocab_size:
            return ""
        delta = self._stream.step(self._tokenizer.hf, token_id)
        return delta or ""


def _eos_ids(root: Path) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        path = root / name
        if not path.is_file():
            continue
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is None:
            continue
        return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)
    return ()
