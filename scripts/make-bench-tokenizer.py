#!/usr/bin/env python3
"""Write .whl/bench-tokenizer.tar.xz: a byte-level BPE tokenizer of 128,000 tokens (Llama-3's
vocabulary is 128,256) trained on this interpreter's standard library sources, for
`python -m benchmarks structured --tokenizer` on the GPU machine (gpu_validate.sh unpacks it
to /tmp/site/bench-tokenizer-128k.json). No Llama-3 tokenizer is on the machines; grammar
masks and compiles cost in proportion to the vocabulary and the variety of its strings, which
a 512-token tokenizer does not show. Deterministic for a given standard library. ~2-4 min on
one core."""

from __future__ import annotations

import sys
import sysconfig
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 128_000
NAME = "bench-tokenizer-128k.json"


def sources() -> Iterator[str]:
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        yield path.read_text(errors="ignore")


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".whl")
    out.mkdir(exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    t0 = time.time()
    tok.train_from_iterator(sources(), trainer)
    json_path = out / NAME
    tok.save(str(json_path))
    with tarfile.open(out / "bench-tokenizer.tar.xz", "w:xz") as tar:
        tar.add(json_path, arcname=NAME)
    json_path.unlink()
    took = time.time() - t0
    print(f"{tok.get_vocab_size()} tokens in {took:.0f} s: {out}/bench-tokenizer.tar.xz")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
