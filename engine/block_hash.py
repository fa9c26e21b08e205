"""The chained block hash shared by the router, the workers and the prefix index.

    h_i = H(h_{i-1} || tokens of full block i || extra)

`H` is xxh3-128 with a fixed seed, so a hash is the same in every process and on every
machine (never Python's salted `hash`). `extra` binds the hash to the model and to an optional
cache salt (tenant isolation): two requests share cached blocks only when the model id, the
salt and every token of every block up to that point are equal. Only full blocks are hashed;
the trailing partial block of a prompt has no hash and is never shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", bytes)
"""16 bytes identifying a full block and, through the chain, every token before it."""

_SEED = 0x7064_7365_7276_6531  # "pdservE1": part of the on-wire format, never change
_ROOT = BlockHash(b"\x00" * 16)


def hash_extra(model_id: str, cache_salt: str = "") -> bytes:
    """The `extra` bytes of every block of a request: model id and cache salt."""
    return f"{model_id}\x1f{cache_salt}".encode()


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int] | np.ndarray, extra: bytes
) -> BlockHash:
    """Hash one full block given its parent's hash (None for the first block)."""
    h = xxhash.xxh3_128(seed=_SEED)
    h.update(parent if parent is not None else _ROOT)
    h.update(np.asarray(token_ids, dtype=np.uint32).tobytes())
    h.update(extra)
    return BlockHash(h.digest())


def hash_chain(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (len(token_ids) // block_size of them).

    `parent` continues an existing chain (the hash of the block before token_ids[0]).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = np.asarray(token_ids, dtype=np.uint32)
    hashes: list[BlockHash] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
