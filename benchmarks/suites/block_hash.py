"""The block hash's cost: xxh3-128 (fixed seed) against SHA-256 (collision resistant, the
default beyond loopback), side by side in one run, over the hash chain of one prompt (what
the router computes per request on its event loop, and a worker per prompt).

Prompts of 512 / 2048 / 8192 / 32768 tokens in blocks of 16 (`--block-size`); the two
algorithms alternate within each round, so both see the same machine state; the figure is
the median over `--rounds`.

    python -m benchmarks block_hash [--rounds 200] [--block-size 16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence

from benchmarks.harness.table import Table
from vocabulary.block_hash import HashAlgorithm, hash_chain, hash_extra, scoped_salt


def chain_us(tokens: list[int], block_size: int, extra: bytes, alg: HashAlgorithm) -> float:
    t0 = time.perf_counter()
    hash_chain(tokens, block_size, extra, algorithm=alg)
    return (time.perf_counter() - t0) * 1e6


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    extra = hash_extra("Meta-Llama-3-8B-Instruct", scoped_salt("acme", ""))
    print(f"block size {args.block_size}, median of {args.rounds} rounds")
    rows = []
    for n in (512, 2048, 8192, 32768):
        tokens = [rng.randrange(128256) for _ in range(n)]
        times: dict[HashAlgorithm, list[float]] = {a: [] for a in HashAlgorithm}
        for r in range(args.rounds + 5):
            order = list(HashAlgorithm) if r % 2 == 0 else list(reversed(HashAlgorithm))
            for alg in order:
                us = chain_us(tokens, args.block_size, extra, alg)
                if r >= 5:  # warm-up rounds left out
                    times[alg].append(us)
        x = statistics.median(times[HashAlgorithm.XXH3])
        s = statistics.median(times[HashAlgorithm.SHA256])
        blocks = n // args.block_size
        rows.append((f"{n}", f"{blocks}", f"{x:.1f}", f"{s:.1f}", f"{s / x:.2f}x",
                     f"{s / blocks:.2f} µs"))  # fmt: skip
    header = ("prompt tokens", "blocks", "xxh3 (µs)", "sha256 (µs)", "sha256 / xxh3",
              "sha256 per block")  # fmt: skip
    print(Table.of(header, rows, "r" * len(header)).markdown())
