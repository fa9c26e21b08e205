"""The engine thread's detokenization cost per request and per token, side by side in one run:
`IncrementalDetokenizer` (the prompt's last few tokens as context, ids the tokenizer does
not know skipped) against a stream holding the whole prompt as context and every id (how it
was before), after prompts of 512 / 2048 / 8192 tokens, for tokens the tokenizer knows and
for ids beyond its vocabulary (what a dummy-weight model over a stand-in tokenizer samples:
the GPU engine-step benchmark's case).

    python -m benchmarks detokenize [--tokens 256]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from tokenizers.decoders import DecodeStream

from benchmarks.harness.table import Table
from deploy.checkpoints.checkpoint_files import CORPUS
from deploy.checkpoints.make_model import cached_tiny_model
from vocabulary.tokenizer import Tokenizer


class WholePromptStream:
    """The previous detokenizer: the whole prompt as context, every id kept."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int]) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(ids=list(prompt), skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer.hf, token_id) or ""


class Pushes(Protocol):
    def push(self, token_id: int) -> str: ...


def timed(make: Callable[[], Pushes], ids: list[int]) -> tuple[float, float]:
    """(µs of the first push, µs per later push)."""
    stream = make()
    t0 = time.perf_counter()
    stream.push(ids[0])
    t1 = time.perf_counter()
    for t in ids[1:]:
        stream.push(t)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e6, (t2 - t1) * 1e6 / max(len(ids) - 1, 1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args(argv)
    tok = Tokenizer.from_model_dir(cached_tiny_model())
    corpus = tok.encode(CORPUS.read_text(), add_special_tokens=False)
    while len(corpus) < 8192 + args.tokens:
        corpus += corpus
    rng = random.Random(0)
    unknown = [rng.randrange(tok.vocab_size, 128256) for _ in range(args.tokens)]
    rows = []
    for n in (512, 2048, 8192):
        prompt = corpus[:n]
        for label, ids in (("known", corpus[n : n + args.tokens]), ("unknown ids", unknown)):
            now = timed(lambda: tok.detokenizer(prompt), ids)  # noqa: B023
            before = timed(lambda: WholePromptStream(tok, prompt), ids)  # noqa: B023
            rows.append((f"{n}", label, f"{now[0]:.0f} / {before[0]:.0f}",
                         f"{now[1]:.2f} / {before[1]:.2f}"))  # fmt: skip
    header = ("prompt", "outputs", "first push: now / before (µs)", "per token: now / before (µs)")
    print(Table.of(header, rows, "llll").markdown())
